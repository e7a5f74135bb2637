"""`rollingkv bench`: decode speed of the split KV cache against its PCIe floor and vanilla llama.cpp, and serving under load.

cli.py holds the click group (tail, load, plot, show); tail_grid.py bench tail's configuration and cells (one llama-bench
command each), tail.py runs them and writes the JSON report, tail_report.py prints and checks a report; arithmetic.py its
arithmetic (windows, tail bytes, floors, the -ngl choice, targets), without I/O; load.py serving under load; gguf.py
the model's shapes and weight sizes read from its GGUF; plot.py the PNG (matplotlib).
"""
