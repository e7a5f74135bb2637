"""The patched llama.cpp as a library: the pin and its sources (upstream.py), our patch series (patchset.py), the
build (builder.py), binding the built libllama (llama_ext.py) and running it in a child process (child.py), the
child processes' ties and deaths (procs.py), and the cache paths and environment names (paths.py). No click."""
