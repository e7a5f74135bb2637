"""Limits of llama.cpp that every command checks before a child starts (no imports: anything may use it)."""

from __future__ import annotations

# ggml's GGML_MAX_N_THREADS: llama.cpp crashed (SIGSEGV, in its threadpool) on a thread count far above it (-t 100000),
# so every command's thread count stops there: the gates' --threads, bench tail's -t, llama-server's -t/-tb after `--`
MAX_THREADS = 512
MAX_THREADS_WHY = "ggml's GGML_MAX_N_THREADS; llama.cpp crashed on 100000"
