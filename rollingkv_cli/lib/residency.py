"""THE residency request: what a command asks the split cache for (mode, window or head split or budget, tail types,
CPU part, link, window policy), the rules by which those settings exclude each other, and the one rendering of it as
llama-server / llama-bench arguments and as the library's parameters (llama_ext.make_params).

Every command that takes residency flags (gate equiv/needle/matrix/vram, bench tail/load, serve) builds one and asks it
`check`; its usage errors name the flags (or config keys) the way the user gave them. No click."""

from __future__ import annotations

from dataclasses import dataclass, fields

from rollingkv_cli.kvtypes import TAIL_AUTO

MODES = ("auto", "window", "head", "off")
WINDOW_POLICIES = ("elastic", "static", "blocks")
PLACEMENTS = ("auto", "upstream", "sequences")  # where a unified cache puts new tokens (--kv-placement; API 11)

# how llama-server and llama-bench spell each field (the patched common/arg.cpp and llama-bench share the parsers)
FLAGS = {"mode": "--kv-residency-mode", "window_cells": "--kv-window-cells", "device_heads": "--kv-device-heads",
         "vram_target": "--vram-target", "type_k_tail": "-ctkt", "type_v_tail": "-ctvt",
         "tail_cpu_frac": "--kv-tail-cpu-frac", "pcie_bw_gbps": "--pcie-bw-gbps", "windows": "--kv-windows"}


class ResidencyConflict(ValueError):
    """Settings that are fine alone but not together: a usage error (exit 2) in every command."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class ResidencyRequest:
    """None everywhere: the library's defaults (auto, no budget, the window's types as the tail's, auto CPU part)."""

    mode: str | None = None
    window_cells: int | None = None  # > 0: an explicit window per stream
    device_heads: int | None = None  # > 0: an explicit head split, KV heads per layer on the device
    vram_target: int | None = None  # MiB
    type_k_tail: str | None = None  # a tail type or "auto"
    type_v_tail: str | None = None
    tail_cpu_frac: float | str | None = None  # "auto" or 0..1
    pcie_bw_gbps: float | None = None
    windows: str | None = None  # elastic | static

    @property
    def splits(self) -> bool:
        return (self.mode or "auto") != "off"

    def auto_tail_axes(self, names: dict[str, str] | None = None) -> list[str]:
        """The flags (as named) whose tail type is left to the planner."""
        names = {**FLAGS, **(names or {})}
        return [names[k] for k in ("type_k_tail", "type_v_tail") if getattr(self, k) == TAIL_AUTO]

    def check(self, names: dict[str, str] | None = None, *, one_size: bool = False) -> None:
        """ResidencyConflict for the first rule these settings break.

        names: how the user gave a field, where not as its llama-server flag (serve's config keys, --cache-type-k-tail);
        one_size: a run measures one split, so a window, a head split and a budget exclude each other (the gates and
        benches); serve lets a --vram-target bound an explicit window or head split (llama-server warns past it)."""
        n = {**FLAGS, **(names or {})}
        window, heads, budget, mode = self.window_cells, self.device_heads, self.vram_target, self.mode
        if one_size and window and budget:
            raise ResidencyConflict(f"give {n['window_cells']} or {n['vram_target']}, not both")
        if heads and window:
            raise ResidencyConflict(f"{n['device_heads']} and {n['window_cells']} exclude each other (a head split or a window split)",
                                    "give one of them")
        if one_size and heads and budget:
            raise ResidencyConflict(f"give {n['device_heads']}, {n['window_cells']} or {n['vram_target']}, one of them")
        if heads and mode in ("window", "off"):
            raise ResidencyConflict(f"{n['device_heads']} {heads} sets a head split, which {n['mode']} {mode} does not make: "
                                    "use head (or auto, which it then means)")
        if window and mode == "head":
            raise ResidencyConflict(f"{n['window_cells']} {window} sets a window, which {n['mode']} head does not make: "
                                    f"use --kv-device-heads N for the head split, or {FLAGS['mode']} window")
        auto = self.auto_tail_axes(names)
        if auto and mode == "off":
            raise ResidencyConflict(f"{' and '.join(auto)} auto chooses the type of a split's tail, and {n['mode']} off never splits",
                                    "use --kv-residency-mode window, head or auto, or give the tail a type")

    def server_args(self) -> list[str]:
        """llama-server's (and llama-bench's) residency flags; the mode always (the reference's `off` included), the
        rest only where set and only when the cache may split."""
        args = ["--kv-residency-mode", self.mode or "auto"] if self.mode is not None else []
        if not self.splits:
            return args
        for key in ("window_cells", "device_heads", "vram_target", "type_k_tail", "type_v_tail", "tail_cpu_frac",
                    "pcie_bw_gbps", "windows"):
            value = getattr(self, key)
            if value is None or (key in ("window_cells", "device_heads", "vram_target") and not value):
                continue
            args += [FLAGS[key], _text(value)]
        return args

    def params(self) -> dict:
        """The library's parameters (llama_ext.Extension.make_params keywords), as the gate runner takes them."""
        out: dict = {"mode": self.mode or "auto", "window_cells": self.window_cells or 0, "vram_target_mib": self.vram_target or 0,
                     "type_k_tail": self.type_k_tail, "type_v_tail": self.type_v_tail}
        for key in ("device_heads", "pcie_bw_gbps", "tail_cpu_frac", "windows"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_params(cls, params: dict | None) -> "ResidencyRequest":
        """The inverse of params() (None: the resident reference, mode off)."""
        if not params:
            return cls(mode="off")
        known = {f.name for f in fields(cls)}
        # 0 is the library's "not set" for the sizes
        kw = {k: v for k, v in params.items() if k in known and not (k in ("window_cells", "device_heads") and v == 0)}
        if params.get("vram_target_mib"):
            kw["vram_target"] = params["vram_target_mib"]
        return cls(**kw)


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
