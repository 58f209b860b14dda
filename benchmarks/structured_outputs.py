"""What structured outputs cost per step: tokens/s of the same 32 requests with and without a grammar.

    python benchmarks/structured_outputs.py [--model PATH] [--num-requests 32] [--max-tokens 64] [--rounds 2]

Default model: the default model (SmolLM2-135M-Instruct, 49,152 tokens: each mask is 1,536 int32 words).
Three workloads, each `--num-requests` prompts decoding `--max-tokens` tokens at temperature 0.8:

    plain     no constraint (ignore_eos, so every request runs to max_tokens)
    regex     `[a-z ,.]{500}`: never complete within max_tokens, so EOS is never allowed and every
              request runs to max_tokens too: the same tokens as plain, plus a mask per row per step
    json      a small JSON Schema: outputs end when the object closes (fewer tokens; tok/s still compares)

One engine, warmed up on each workload, then the workloads alternate for `--rounds` rounds (2) (drift on a
shared machine hits all alike); the best round of each is reported, with the CPU it ran on. The ratio
regex/plain is the per-step price of the masks (llguidance's mask, its unpacking, the masked fill).
"""

from __future__ import annotations

import argparse
import os
import time

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.cpu.cpu_info import CpuInfo

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TOPICS = ["a baker", "a pilot", "a child", "a doctor", "a farmer", "a singer", "a sailor", "a poet"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the default model)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=args.num_requests)
    prompts = [f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as JSON:" for i in range(args.num_requests)]
    constraints = {"plain": None, "regex": StructuredOutputsParams(regex="[a-z ,.]{500}"),
                   "json": StructuredOutputsParams(json=SCHEMA)}

    def run(name: str, max_tokens: int = args.max_tokens) -> tuple[float, int]:
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=name == "plain",
                                 structured_outputs=constraints[name]) for i in range(args.num_requests)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

    for name in constraints:  # warm-up (and the grammars compiled once, as a server would have them cached)
        run(name, max_tokens=4)
    best: dict[str, tuple[float, int]] = {}
    for r in range(args.rounds):
        for name in constraints:
            elapsed, tokens = run(name)
            print(f"round {r}: {name} {tokens} tokens in {elapsed:.2f} s", flush=True)
            if name not in best or tokens / elapsed > best[name][1] / best[name][0]:
                best[name] = (elapsed, tokens)
    print(CpuInfo.read(), f"load average {os.getloadavg()[0]:.1f}")
    print(f"{args.model or 'default model (SmolLM2-135M-Instruct)'}, {args.num_requests} requests, up to "
          f"{args.max_tokens} tokens each, temperature 0.8, best of {args.rounds}:")
    plain = best["plain"][1] / best["plain"][0]
    for name, (elapsed, tokens) in best.items():
        rate = tokens / elapsed
        print(f"  {name:6s} {tokens:5d} tokens in {elapsed:6.2f} s: {rate:7.1f} tok/s ({rate / plain:.2f}x plain)")


if __name__ == "__main__":
    main()
