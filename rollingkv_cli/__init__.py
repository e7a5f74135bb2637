"""rollingkv: exact long-context inference with a KV cache split between VRAM and pinned host memory."""

__version__ = "0.1.0"
