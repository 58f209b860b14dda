"""Speculative decoding on the default model: a "repeat this text" chat task, single stream.

    python benchmarks/spec_decode.py [--model M] [--k 4] [--max-tokens 160] [--repeats 3]

The same engine settings with and without n-gram speculation (greedy, so the text must be the
same); printed: tokens/s of each (median of --repeats), the speed-up, the acceptance rate and per
draft position. Copying tasks are where prompt lookup shines: the answer is in the prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from minivllm import LLM, SamplingParams

TEXT = ("The paged KV cache stores keys and values in fixed-size blocks. A block table maps each "
        "sequence's logical blocks to physical blocks in a shared pool, so memory is allocated on "
        "demand and freed blocks can be reused at once. Prefix caching keeps full blocks findable by "
        "a hash of their tokens, and the scheduler mixes prefill chunks with decodes in every step.")
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}]


def timed(llm: LLM, sp: SamplingParams) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    out = llm.chat(MESSAGES, sp, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - t0, out.text, len(out.token_ids)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    results = {}
    for name, cfg in (("plain", None), ("ngram", spec)):
        llm = LLM(args.model, speculative_config=cfg)
        timed(llm, SamplingParams(temperature=0, max_tokens=8))  # warm-up
        runs = [timed(llm, sp) for _ in range(args.repeats)]
        secs = statistics.median(r[0] for r in runs)
        results[name] = (runs[0][2] / secs, runs[0][1], llm.get_stats())
        print(f"{name:>6}: {results[name][0]:6.1f} tok/s ({runs[0][2]} tokens, median of {args.repeats})")
        llm.shutdown()
    plain, ngram = results["plain"], results["ngram"]
    stats = ngram[2]
    print(f"speed-up {ngram[0] / plain[0]:.2f}x; same text: {plain[1] == ngram[1]}; acceptance "
          f"{stats.acceptance_rate:.0%} (per position: {', '.join(f'{a:.0%}' for a in stats.acceptance_per_position)})")
    print(f"text: {ngram[1][:120]!r}...")
    return 0 if plain[1] == ngram[1] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
