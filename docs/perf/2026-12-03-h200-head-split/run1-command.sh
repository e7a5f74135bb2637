# the checks: the head split's op cases on CUDA0 (and perturbed), the CPU part's op cases, the CPU part's kernel
# against a read scan (f16/q8_0/q4_0, 15 threads), the GPU test suite (head split gates included)
bash scripts/device/check.sh --prebuilt head-op-tests hybrid-op-tests cpu-decode-bench gpu-tests
