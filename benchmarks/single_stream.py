"""Single-stream decode speed on the default model (same as `minivllm bench --single-stream`)."""

import sys

from minivllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--single-stream", *sys.argv[1:]]))
