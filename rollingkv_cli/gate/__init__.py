"""`rollingkv gate`: prove that the split KV cache reproduces the fully resident run.

- `gate equiv` decodes one token sequence teacher-forced twice, each in its own process (llama_cpp binds
  one library per process): a reference (our build with residency off, or another build's libllama) and
  a candidate (our build with the residency parameters), and compares every position's next-token
  distribution (metrics). The candidate compares its logits against the reference's on the fly (runner).
- `gate needle` asks a resident and a split llama-server for a fact placed in the tail (needle).
- `gate vram` samples NVML while a llama-server with --vram-target decodes a long sequence (vram).
- `gate matrix` runs equiv over tail types x split points, the quantized parts' exactness, and the needle,
  and writes a JSON report and a markdown table (matrix).

The click commands are in cli/ (one module per subcommand); the modules here hold the work, without click.
Exit status of every gate: 0 pass, 1 fail (or an error), 2 usage error; gate vram 3 without an NVIDIA GPU
(as `rollingkv probe pcie`); gate needle (and matrix) 4 when the resident model itself misses the needle.
"""
