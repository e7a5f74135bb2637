"""The hardware rollingkv plans with: the host<->GPU link (pcie.py: NVML and sysfs, the theoretical rate, the figure
the server plans with; profile.py: the per-machine cache of measurements; link_bw.py: its measured speed, timed by
libllama in a child), the CPU decode attention's speed (cpu_attn.py, measured by libllama in a child) and the host CPU
(hostinfo.py). No click: `rollingkv probe pcie` (commands/probe.py) shows them."""
