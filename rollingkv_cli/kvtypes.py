"""The KV cache types, in one place (a tiny module: the click commands import it without loading anything).

TAIL_TYPES is the list the library accepts for a split cache's parts (the host tail, and the window of every split
command here): ggml_rkv_tail_type_names() of the patched libggml. It is written out so that --help and the docs need no
build, and tests/lib/test_llama_ext.py asks the library for its list and requires the same one; `serve` asks the active
build's library at start-up too (library_tail_types), so a build that takes fewer types is said so before llama-server
starts. WINDOW_TYPES adds what llama.cpp's -ctk/-ctv take for an unsplit cache (common/arg.cpp kv_cache_types): iq4_nl,
which the split refuses. TAIL_AUTO ("auto") is no type but the planner's choice, accepted wherever a tail type is.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

TAIL_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
WINDOW_TYPES = TAIL_TYPES[:6] + ("iq4_nl",) + TAIL_TYPES[6:]
FLOAT_TYPES = ("f32", "f16", "bf16")  # the rest are block-quantized (blocks of 32): already compact
# not a type: the planner chooses the tail's type when the cache spills (-ctkt/-ctvt auto, rolling-KV API 7; lossy, so
# only where asked for). Every option that takes a tail type takes TAIL_TYPE_CHOICES.
TAIL_AUTO = "auto"
TAIL_TYPE_CHOICES = TAIL_TYPES + (TAIL_AUTO,)
TAIL_TYPE_NAMES_SYMBOL = "ggml_rkv_tail_type_names"


def library_tail_types(lib_dir: Path) -> tuple[str, ...] | None:
    """The tail types the build in lib_dir accepts, asked of its libggml-base (ggml_rkv_tail_type_names); None when the
    library cannot be loaded or predates the function."""
    for name in ("libggml-base.so", "libggml.so"):
        path = Path(lib_dir) / name
        if not path.exists():
            continue
        try:
            fn = getattr(ctypes.CDLL(str(path)), TAIL_TYPE_NAMES_SYMBOL)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_char_p
        fn.argtypes = []
        text = fn()
        if text:
            return tuple(t.strip() for t in text.decode().split(",") if t.strip())
    return None
