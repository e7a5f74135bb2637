"""`rollingkv serve`: a supervised llama-server with the rolling-KV flags.

cli.py is the click command; settings.py the settings, the config file and the checks of flags against each other;
launch.py the pre-flight checks on the build and the model, llama-server's command line and the supervision;
status.py what the running server says (its plan, metrics, the live status line); server.py the llama-server
process harness (free port, /health, terminate then kill), shared with the gates and the benches.
"""
