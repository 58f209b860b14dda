"""What one grammar mask costs, ordinary and costly, and what the first structured request costs a process.

    python benchmarks/grammar_budget.py [--model PATH] [--tokens 120] [--walks 3]

Three measurements behind `EngineConfig.grammar_mask_budget_ms` and the mask fill (engine/structured_output/grammar.py):
  1. ordinary grammars (the server tests' person schema, a tool-call array, json_object, a date regex, a
     Lark sum, a choice): each walked `--walks` times for `--tokens` tokens, a pseudo-random allowed token
     at a time; the CPU time of every mask (`time.thread_time`, what the budget counts), its largest;
  2. costly grammars: a choice of one 150,000-character string, `a{1000000}`, a schema that requires itself:
     whether the compiler refuses them, what it says, and its CPU time to say so;
  3. the first fill of a process: a fresh interpreter imports minivllm (timed), compiles a regex, fills its
     first mask (timed) and reports whether torch's compiler stack (torch._dynamo) was loaded by it.
The default budget is set well above (1) and below the steady masks of (2) (docs/concepts/structured-outputs.md).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import textwrap
import time

import torch

from minivllm.config import EngineConfig
from minivllm.engine.processing.tokenizer import get_tokenizer
from minivllm.engine.structured_output.grammar import GrammarCompiler
from minivllm.structured_outputs import StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "London", "Rome"]}},
          "required": ["name", "age", "city"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TOOLS = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": n}, "parameters": WEATHER}, "required": ["name", "parameters"]}
    for n in ("get_weather", "get_forecast")]}}
ORDINARY = {"person": dict(json=PERSON), "tool_calls": dict(json=TOOLS), "json_object": dict(json_object=True),
            "date": dict(regex=r"[12][0-9]{3}-[01][0-9]-[0-3][0-9]"),
            "lark_sum": dict(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]+/'),
            "choice": dict(choice=["red wine", "white", "rosé"])}
COSTLY = {"choice_150k": dict(choice=["x" * 150_000]), "regex_1e6": dict(regex="a{1000000}"),
          "self_required": dict(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})}
FIRST_FILL = """
    import sys, time
    t = time.perf_counter(); import minivllm; from minivllm.engine.structured_output.grammar import GrammarCompiler
    imported = time.perf_counter() - t
    from minivllm.engine.processing.tokenizer import get_tokenizer
    from minivllm.structured_outputs import StructuredOutputsParams
    tok = get_tokenizer({model!r}); vocab = len(tok)
    m = GrammarCompiler(tok, vocab, frozenset([tok.eos_token_id])).matcher(StructuredOutputsParams(regex="[0-9]{{3}}"))
    dynamo_before = "torch._dynamo" in sys.modules
    t = time.perf_counter(); m.bitmasks(); fill = time.perf_counter() - t
    print(imported, fill, dynamo_before, "torch._dynamo" in sys.modules)
"""


def allowed(row: torch.Tensor, vocab: int) -> list[int]:
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (W, 32)
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def walk_ms(compiler: GrammarCompiler, so: StructuredOutputsParams, tokens: int, seed: int) -> list[float]:
    """CPU ms of each mask along one pseudo-random walk through the grammar."""
    m, rng, out = compiler.matcher(so), random.Random(seed), []
    for _ in range(tokens):
        start = time.thread_time()
        row = m.bitmasks()[0]
        out.append((time.thread_time() - start) * 1e3)
        choices = [t for t in allowed(row, compiler.vocab_size) if t not in compiler.eos_token_ids]
        if not choices or m.is_complete or not m.accept(rng.choice(choices)):
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the default model)")
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--walks", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from minivllm.default_model import default_model_dir
        args.model = str(default_model_dir())
    tok = get_tokenizer(args.model)
    compiler = GrammarCompiler(tok, len(tok), frozenset([tok.eos_token_id]), strict_json_schema=True)
    compiler.ll_tokenizer  # noqa: B018  (built once, not timed below)
    print(f"1. ordinary grammars, CPU ms a mask over {args.walks} walks of up to {args.tokens} tokens "
          f"(a {len(tok)}-token vocabulary)")
    worst = 0.0
    for name, kw in ORDINARY.items():
        so = StructuredOutputsParams(**kw)
        times = [t for seed in range(args.walks) for t in walk_ms(compiler, so, args.tokens, seed)]
        times.sort()
        worst = max(worst, times[-1])
        print(f"   {name:12s} masks {len(times):4d}  median {times[len(times) // 2]:6.2f}  "
              f"p99 {times[int(len(times) * 0.99)]:6.2f}  max {times[-1]:6.2f}")
    print(f"   largest ordinary mask: {worst:.2f} ms")
    budget = EngineConfig.__dataclass_fields__["grammar_mask_budget_ms"].default
    print(f"2. costly grammars, without a budget (then the default, {budget:g} ms): the compiler's CPU time, "
          "its verdict")
    for limit in (float("inf"), budget):
        costly = GrammarCompiler(tok, len(tok), frozenset([tok.eos_token_id]), mask_budget_ms=limit)
        costly._ll_tokenizer = compiler.ll_tokenizer
        for name, kw in COSTLY.items():
            start = time.thread_time()
            try:
                times = walk_ms(costly, StructuredOutputsParams(**kw), 4, 0)
                verdict = f"accepted; masks {' '.join(f'{t:.0f}' for t in times)} ms"
            except ValueError as e:
                verdict = f"refused: {str(e)[:100]}"
            print(f"   {name:14s} {(time.thread_time() - start) * 1e3:6.0f} ms CPU  {verdict}")
    print("3. the first fill of a fresh process (3 runs)")
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(FIRST_FILL.format(model=args.model))],
                              capture_output=True, text=True, check=True)
        imported, fill, before, after = done.stdout.split()[-4:]
        print(f"   import minivllm {float(imported):5.2f} s   first fill {float(fill) * 1e3:7.1f} ms   "
              f"torch._dynamo loaded: before {before}, after {after}")


if __name__ == "__main__":
    main()
