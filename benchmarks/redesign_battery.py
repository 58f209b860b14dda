"""The redesign battery: the tokens and logprobs a change to the engine's core must leave as they were.

    python benchmarks/redesign_battery.py --out A.json              # run every case, record every output
    python benchmarks/redesign_battery.py --compare A.json B.json   # one line per case; exit 1 if any differ
    PYTHONPATH=/path/to/other/checkout python benchmarks/redesign_battery.py --out B.json

A redesign of the core (where n > 1 forks, where a hybrid model's state is kept, how a step is committed)
should change how the engine works and nothing it returns. This script makes that checkable: record the
battery on the tree before the change, again after, and compare. The minivllm it ran is printed and
stored (`minivllm`): with PYTHONPATH pointing at another checkout, the same battery runs that tree.

What runs: every case of benchmarks/redesign_battery_cases.py (greedy and seeded sampling with logprobs
and prompt logprobs, n > 1 seeded, greedy and unseeded, stops, n-gram and draft-model speculation,
structured outputs, pool pressure, chunked prefill, prefix reuse, injected failures, beam search) on each
family's tiny random checkpoint (minivllm/teaching/checkpoints.py): Llama, Qwen3 (q/k norms), Gemma 3 (a
window of one block: two KV-cache groups), and the Qwen3.5 hybrid with its prefix state cache and without.
fp32, one thread, fixed seeds, the kernel tuner off (its fixed rules): the same tree gives the same file.

What is recorded, per request: the prompt's token ids, each completion's token ids, finish and stop
reasons, text, and the logprob of every candidate the request asked for (sampled token included), per
generated token and per prompt token. A combination the engine refuses is recorded as {"refused":
message}, so a change in what is refused shows up too; any other exception as {"error": ...}.

What --compare checks: token ids, finish reasons, texts, errors and refusals exactly; every float (a
logprob) within --atol (default 1e-4), stored unrounded. A redesign may change the shape of a batch (n > 1
children computing their own last partial block), which moves a logprob by ~1e-6, never a token.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import minivllm  # noqa: E402
from minivllm import LLM, BeamSearchOutput, RequestOutput  # noqa: E402
from minivllm.teaching.checkpoints import make_tiny_model  # noqa: E402
from redesign_battery_cases import CASES, Case  # noqa: E402

# Every engine of the battery: small pages so short prompts cross blocks, and nothing measured
ENGINE = dict(dtype="float32", device="cpu", warmup=False, tuning="off", block_size=8, num_kv_blocks=128,
              max_num_seqs=16, seed=0)
# family -> (make_tiny_model options, engine options of its own)
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama": (dict(family="llama"), {}),
    "qwen3": (dict(family="qwen3"), {}),
    "gemma3": (dict(family="gemma3", num_layers=4), {}),  # sliding_window 8: one block of 8
    # a snapshot of the linear-attention state every 16 prompt tokens, so 40-token prompts hit it
    "qwen3_5": (dict(family="qwen3_5", num_layers=4), dict(state_cache_stride=16)),
    "qwen3_5_nocache": (dict(family="qwen3_5", num_layers=4), dict(enable_prefix_caching=False)),
}
DRAFT = dict(family="llama", num_layers=1, seed=1)  # the tiny tokenizer is the same for every family


# --- recording ----------------------------------------------------------------------------------------
def candidates(position: dict | None) -> dict[str, float] | None:
    """One position's candidates: token id (a JSON key, so a string) -> logprob."""
    return None if position is None else {str(t): lp.logprob for t, lp in position.items()}


def record_request(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_token_ids": list(out.prompt_token_ids),
        "error": out.error,
        "prompt_logprobs": None if out.prompt_logprobs is None else [candidates(p) for p in out.prompt_logprobs],
        "completions": [{
            "index": c.index, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "text": c.text, "cumulative_logprob": c.cumulative_logprob,
            "logprobs": None if c.logprobs is None else [candidates(p) for p in c.logprobs],
        } for c in out.outputs],
    }


def record_beams(out: BeamSearchOutput) -> dict[str, Any]:
    return {"beams": [{"tokens": list(b.tokens), "cum_logprob": b.cum_logprob, "text": b.text,
                       "finish_reason": b.finish_reason,
                       "logprobs": [candidates(p) for p in b.logprobs]} for b in out.sequences]}


def run_case(model_dir: str, engine: dict[str, Any], draft_dir: str, case: Case) -> dict[str, Any]:
    """The case on a fresh engine: its requests' records and info, or what refused or broke it."""
    llm = None
    try:
        llm = LLM(model_dir, **{**ENGINE, **engine, **case.engine(draft_dir)})
        outcome = case.run(llm)
    except (ValueError, NotImplementedError) as e:  # the engine's refusals (config or request checks)
        return {"refused": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001 - recorded, so that the compare shows it, and the battery goes on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if llm is not None:
            llm.shutdown()
    records = [record_beams(o) if isinstance(o, BeamSearchOutput) else record_request(o) for o in outcome.outputs]
    return {"requests": records, "info": outcome.info}


def checksum(model_dir: Path) -> str:
    """Of the weights and config: a compare across trees says so if their tiny models differ."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((model_dir / name).read_bytes())
    return h.hexdigest()[:16]


def run_battery(only: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny tensors; and one thread's summation order on every machine
    result: dict[str, Any] = {"minivllm": minivllm.__file__, "torch": torch.__version__, "models": {},
                              "seconds": {}, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        made: dict[str, Path] = {}

        def checkpoint(options: dict[str, Any]) -> Path:
            key = json.dumps(options, sort_keys=True)
            if key not in made:
                made[key] = make_tiny_model(Path(tmp) / f"m{len(made)}", **options)
                result["models"][key] = checksum(made[key])
            return made[key]

        draft_dir = str(checkpoint(DRAFT))
        for family, (model_options, engine) in FAMILIES.items():
            model_dir = str(checkpoint(model_options))
            for case in CASES:
                name = f"{family}/{case.name}"
                if only and only not in name:
                    continue
                start = time.perf_counter()
                result["cases"][name] = rec = run_case(model_dir, engine, draft_dir, case)
                result["seconds"][name] = round(time.perf_counter() - start, 3)
                status = outcome(rec) if outcome(rec) != "ran" else f"{len(rec['requests'])} requests {rec['info'] or ''}"
                print(f"{name:40s} {result['seconds'][name]:6.2f} s  {status}", flush=True)
    return result


# --- comparing ----------------------------------------------------------------------------------------
def differences(a: Any, b: Any, atol: float, path: str, out: list[str], worst: list[float]) -> None:
    """Append to `out` where `a` and `b` differ: floats beyond `atol`, anything else at all. `worst[0]`:
    the largest float difference seen within the tolerance."""
    if is_number(a) and is_number(b) and (isinstance(a, float) or isinstance(b, float)):
        d = abs(a - b) if a != b else 0.0  # equal infinities are equal
        if d > atol:
            out.append(f"{path}: {a!r} vs {b!r} (|diff| {d:.2e} > {atol:g})")
        else:
            worst[0] = max(worst[0], d)
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append(f"{path}: keys {sorted(set(a) - set(b))} only in A, {sorted(set(b) - set(a))} only in B")
        for k in a:
            if k in b:
                differences(a[k], b[k], atol, f"{path}.{k}", out, worst)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            differences(x, y, atol, f"{path}[{i}]", out, worst)
    elif a != b:
        out.append(f"{path}: {short(a)} vs {short(b)}")


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def outcome(case: dict[str, Any]) -> str:
    """"ran", or what refused or broke the case."""
    return next((f"{k}: {case[k]}" for k in ("refused", "error") if k in case), "ran")


def short(x: Any, limit: int = 120) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."


def compare(path_a: str, path_b: str, atol: float) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    print(f"A: {path_a} ({a.get('minivllm')})\nB: {path_b} ({b.get('minivllm')})")
    if a.get("models") != b.get("models"):
        print("NOTE: the tiny checkpoints differ (make_tiny_model changed?): differences may come from that")
    failed, names = 0, list(a["cases"]) + [n for n in b["cases"] if n not in a["cases"]]
    for name in names:
        if name not in a["cases"] or name not in b["cases"]:
            print(f"{name:40s} only in {'A' if name in a['cases'] else 'B'}")
            failed += 1
            continue
        ca, cb = a["cases"][name], b["cases"][name]
        found, worst = [], [0.0]
        if outcome(ca) != outcome(cb):
            found.append(f"{outcome(ca)} vs {outcome(cb)}")
        else:  # "info" holds counters: reported below when they change, never a difference
            differences(*({k: v for k, v in c.items() if k != "info"} for c in (ca, cb)), atol, "", found, worst)
        note = "" if ca.get("info") == cb.get("info") else f"  (info {ca.get('info')} -> {cb.get('info')})"
        if found:
            failed += 1
            more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
            print(f"{name:40s} differs: {found[0]}{more}{note}")
        else:
            print(f"{name:40s} same (max |float diff| {worst[0]:.1e}){note}")
    print(f"{failed} of {len(names)} cases differ")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="run the battery and write its outputs here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two recorded runs")
    parser.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance on logprobs (default 1e-4)")
    parser.add_argument("--only", help="run only the cases whose 'family/case' name contains this")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare, args.atol)
    if not args.out:
        parser.error("give --out FILE to run the battery, or --compare A B")
    print(f"minivllm: {minivllm.__file__}", flush=True)
    start = time.perf_counter()
    result = run_battery(args.only)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{len(result['cases'])} cases in {result['wall_s']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
