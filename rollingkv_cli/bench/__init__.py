"""`rollingkv bench`: decode speed of the split KV cache against its PCIe floor and vanilla llama.cpp.

cli.py holds the click group (tail, plot, show); tail.py the grid (one llama-bench per cell) and the JSON
report; arithmetic.py its arithmetic (windows, tail bytes, floors, the -ngl choice, targets), without I/O;
gguf.py the model's shapes and weight sizes read from its GGUF; plot.py the PNG (matplotlib).
"""
