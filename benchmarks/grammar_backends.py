"""llguidance against xgrammar, the two maintained grammar engines, on the default model's vocabulary.

    python benchmarks/grammar_backends.py [--model PATH] [--num-requests 32] [--steps 48]

What an engine pays for structured outputs, per library: the tokenizer set-up (once per engine), the
compilation of one JSON schema (once per distinct schema), and then per decode step, for every request,
a token bitmask and the advance of its matcher by the token drawn. `--num-requests` matchers walk the
schema together: at each step every one fills its row of a (R, V/32) bitmask, then takes a token from
its allowed set (the same pseudo-random pick for both libraries, so their masks must agree, and the
script checks they do). Timed: the whole step (R masks + R advances), best of 3 walks. The choice made
from these numbers is written in docs/concepts/structured_outputs.md.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from importlib.metadata import version

import torch

from minivllm.cpu.cpu_info import CpuInfo

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "married": {"type": "boolean"}}, "required": ["name", "age", "tags", "married"],
    "additionalProperties": False}


def allowed(row: torch.Tensor, vocab: int) -> list[int]:
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (W, 32)
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def walk(new_matcher, fill, accept, done, R: int, V: int, steps: int) -> tuple[float, list[list[int]]]:
    matchers = [new_matcher() for _ in range(R)]
    rngs = [random.Random(i) for i in range(R)]
    bitmask = torch.zeros(R, (V + 31) // 32, dtype=torch.int32)
    chosen: list[list[int]] = [[] for _ in range(R)]
    elapsed = 0.0
    for _ in range(steps):
        live = [i for i in range(R) if not done(matchers[i])]
        if not live:
            break
        t0 = time.perf_counter()
        for i in live:
            fill(matchers[i], bitmask, i)
        elapsed += time.perf_counter() - t0
        picks = {}
        for i in live:
            ids = allowed(bitmask[i], V)
            picks[i] = ids[rngs[i].randrange(len(ids))] if len(ids) < 50 else ids[rngs[i].randrange(min(8, len(ids)))]
        t0 = time.perf_counter()
        for i in live:
            accept(matchers[i], picks[i])
        elapsed += time.perf_counter() - t0
        for i in live:
            chosen[i].append(picks[i])
    return elapsed, chosen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the default model)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from minivllm.model_source import resolve_model
    folder = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    V = json.load(open(f"{folder}/config.json"))["vocab_size"]
    eos = tok.eos_token_id
    schema = json.dumps(SCHEMA)
    R, results, walks = args.num_requests, {}, {}

    import llguidance
    import llguidance.hf
    import llguidance.torch
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=eos)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})  # compact
    llguidance.LLMatcher(lltok, grammar)  # the first matcher compiles the grammar's lexer
    compile_s = time.perf_counter() - t0
    best, chosen = min((walk(lambda: llguidance.LLMatcher(lltok, grammar),
                             llguidance.torch.fill_next_token_bitmask,
                             lambda m, t: m.consume_token(t), lambda m: m.is_stopped(), R, V, args.steps)
                        for _ in range(3)), key=lambda r: r[0])
    results[f"llguidance {version('llguidance')}"] = (setup, compile_s, best, sum(map(len, chosen)))
    walks["llguidance"] = chosen

    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False)
    compile_s = time.perf_counter() - t0
    best, chosen = min((walk(lambda: xgr.GrammarMatcher(compiled), lambda m, b, i: m.fill_next_token_bitmask(b, i),
                             lambda m, t: m.accept_token(t), lambda m: m.is_terminated(), R, V, args.steps)
                        for _ in range(3)), key=lambda r: r[0])
    results[f"xgrammar {version('xgrammar')}"] = (setup, compile_s, best, sum(map(len, chosen)))
    walks["xgrammar"] = chosen

    print(CpuInfo.read())
    print(f"{R} requests walking one JSON schema, vocabulary {V}, up to {args.steps} steps, best of 3")
    for name, (setup, compile_s, step_s, tokens) in results.items():
        print(f"  {name:22s} tokenizer set-up {setup * 1e3:7.0f} ms, schema compile {compile_s * 1e3:6.1f} ms, "
              f"mask + advance {step_s / tokens * 1e3:.3f} ms a token ({tokens} tokens)")
    same = sum(a == b for a, b in zip(walks["llguidance"], walks["xgrammar"]))
    print(f"  walks identical in both libraries: {same} of {R} (each compiles its own grammar of the schema)")


if __name__ == "__main__":
    main()
