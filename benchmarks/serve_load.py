"""Load on a running server: 32 concurrent streaming chat clients, a quarter hanging up mid-stream.

    minivllm serve --port 8000 &        # in another terminal (or any --model)
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 [--clients 32] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio

from loadgen import percentile, run_load  # benchmarks/loadgen.py, next to this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    prompts = [f"Tell me fact number {i} about the sea." for i in range(args.clients)]
    results, elapsed = asyncio.run(run_load(args.url, prompts, args.max_tokens))
    completed = [r for r in results if not r.disconnected]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    print(f"{len(completed)} completed, {len(results) - len(completed)} hung up, in {elapsed:.2f} s: "
          f"{len(results) / elapsed:.1f} requests/s; TTFT p50 {1e3 * percentile(ttfts, 50):.0f} ms, "
          f"p99 {1e3 * percentile(ttfts, 99):.0f} ms")


if __name__ == "__main__":
    main()
