"""Ways in from outside Python: the `minivllm` command (cli.py) and its benchmarks (bench.py)."""
