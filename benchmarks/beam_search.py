"""Beam search's two ways to share KV blocks, on one small case: blocks held and time per step.

    python benchmarks/beam_search.py [--model PATH] [--beam-width 4] [--max-tokens 32] [--prompts 4] [--rounds 3]

Way A, implemented (minivllm/beam_search.py, vLLM's): each step's beams are one-token requests; their
common prefix's full blocks are prefix-cache hits, and each beam recomputes its tail past its last full
block. Measured: the wall time of each search step (one engine step), the tokens it computed, and
the blocks held while it ran.

Way B, not implemented (forks in the middle of decoding, on top of the n > 1 copy-on-write fork):
estimated from first principles on the same beams (`BeamSearch.history`).
- Blocks: a beam's blocks would be its parent's, shared up to the last full one, plus a partial last
  block of its own: the distinct full-block prefixes among the live beams + one block per beam.
- Time: every step is a decode step of one row per beam. That step is measured on the existing fork
  path, `SamplingParams(n=beam_width)` over the same prompts and lengths (its decode steps after the
  first), plus a copy of the partial block per extra child (`copy_blocks`, timed here too).
The runs alternate (A, B stand-in, A, ...) and the best round of each is reported, with the CPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.beam_search import BeamSearch, new_search
from minivllm.entrypoints.bench import BENCH_MODEL
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.teaching.checkpoints import make_tiny_model


def fork_blocks(beams: list[list[int]], block_size: int) -> int:
    """Blocks way B holds for these live beams while their next token is computed: the full blocks
    (shared by every beam with that prefix) and one partial block each."""
    full = {tuple(t[:(i + 1) * block_size]) for t in beams for i in range(len(t) // block_size)}
    return len(full) + sum(1 for t in beams if len(t) % block_size)


def fork_copies(prev: list[list[int]], beams: list[list[int]], block_size: int) -> int:
    """Copy-on-write copies way B makes at a step: a parent continued by c > 1 beams forks c - 1
    children, each copying the partial block (none when the parent's tokens fill whole blocks)."""
    parents = [tuple(t[:-1]) for t in beams]
    return sum(parents.count(tuple(p)) - 1 for p in prev if parents.count(tuple(p)) > 1 and len(p) % block_size)


def run_a(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> tuple[list[float], list[int], list[int],
                                                                                  list[BeamSearch]]:
    """Way A: per search step, the wall time, the tokens computed and the blocks held (all prompts together)."""
    engine = llm.llm_engine
    bm, execute, held = engine.block_manager, engine.executor.execute_model, []

    def watched(plan):
        held.append(bm.num_blocks - bm.num_free_blocks)
        return execute(plan)

    engine.executor.execute_model = watched
    searches = [new_search(engine, {"prompt_token_ids": p}, params) for p in prompts]
    times, tokens = [], []
    try:
        while not searches[0].done:
            before, t0 = llm.get_stats().num_prefill_tokens, time.perf_counter()
            # LLM.beam_search's loop, one step at a time (run here to time each step)
            outputs = llm.generate([q for s in searches for q in s.step_prompts()],
                                   SamplingParams(temperature=0, max_tokens=1, logprobs=2 * params.beam_width,
                                                  ignore_eos=True, detokenize=False), use_tqdm=False)
            for s in searches:
                mine, outputs = outputs[:len(s.beams)], outputs[len(s.beams):]
                s.advance(mine)
            times.append(time.perf_counter() - t0)
            tokens.append(llm.get_stats().num_prefill_tokens - before)
    finally:
        engine.executor.execute_model = execute
    return times, tokens, held, searches


def run_b_stand_in(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> list[float]:
    """The decode steps way B would run: n = beam_width forked sequences per prompt, one token each a step."""
    engine, step, times = llm.llm_engine, llm.llm_engine.step, []

    def timed():
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        return out

    engine.step = timed
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(n=params.beam_width, temperature=1.0, seed=0, max_tokens=params.max_tokens,
                                    ignore_eos=True, detokenize=False), use_tqdm=False)
    finally:
        engine.step = step
    return times[1:]  # the first step is the prompts' prefill (a step way A has too)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the bench's random Qwen3)")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = args.model or str(make_tiny_model(tempfile.mkdtemp(), **BENCH_MODEL))
    llm = LLM(model, dtype="float32", num_kv_blocks=512)
    B = llm.llm_engine.config.block_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = BeamSearchParams(args.beam_width, args.max_tokens, ignore_eos=True)
    run_a(llm, prompts, params)  # warm-up: the same shapes, both ways
    run_b_stand_in(llm, prompts, params)
    best_a = best_b = None
    for _ in range(args.rounds):
        a = run_a(llm, prompts, params)
        b = run_b_stand_in(llm, prompts, params)
        if best_a is None or sum(a[0][1:]) < sum(best_a[0][1:]):
            best_a = a
        if best_b is None or sum(b) < sum(best_b):
            best_b = b
    times_a, tokens_a, held_a, searches = best_a
    # Way B's blocks and copies, from the beams way A chose (step t's beams are history[t]).
    held_b, copies = [], []
    for t in range(1, args.max_tokens):
        held_b.append(sum(fork_blocks([b.tokens for b in s.history[t]], B) for s in searches))
        copies.append(sum(fork_copies([b.tokens for b in s.history[t - 1]], [b.tokens for b in s.history[t]], B)
                          for s in searches))
    kv = llm.llm_engine.model_runner
    t0 = time.perf_counter()
    for _ in range(20):
        kv.copy_blocks([(0, 1)] * max(1, round(statistics.mean(copies))))
    copy_s = (time.perf_counter() - t0) / 20
    step_a, step_b = statistics.mean(times_a[1:]), statistics.mean(best_b) + copy_s
    print(CpuInfo.read())
    print(f"{model if args.model else 'bench model (random Qwen3, ~30M)'}, fp32, block_size {B}, "
          f"{args.prompts} prompts x {args.prompt_len} tokens, beam_width {args.beam_width}, "
          f"{args.max_tokens} steps, best of {args.rounds}")
    rows = args.prompts * args.beam_width
    print(f"  A (requests + prefix cache): {step_a * 1e3:.1f} ms a step, {statistics.mean(tokens_a[1:]):.1f} tokens "
          f"computed a step ({rows} beams), blocks held mean {statistics.mean(held_a[1:]):.1f} max {max(held_a[1:])}")
    print(f"  B (forks, estimated):        {step_b * 1e3:.1f} ms a step, {rows} tokens computed a step, "
          f"{statistics.mean(copies):.1f} block copies a step, blocks held mean {statistics.mean(held_b):.1f} "
          f"max {max(held_b)}")
    print(f"  A / B time per step: {step_a / step_b:.2f}x")


if __name__ == "__main__":
    main()
