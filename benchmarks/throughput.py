"""The core-engine throughput benchmark (same as `minivllm bench`); see minivllm/entrypoints/bench.py."""

import sys

from minivllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
