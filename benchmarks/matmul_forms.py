"""Single stream with each CPU matmul form, interleaved in one process, against HF `generate`.

    python benchmarks/matmul_forms.py [--rounds 5]

One minivllm engine on the default model (fp32, batch 1, 64 new tokens); each round times one
generation with the measured `MatmulPlan`, with `F.linear` (x W^T) everywhere, with (W x^T)^T
everywhere (what minivllm did before the plan), then HF `generate`. Interleaving makes the other jobs
on a shared machine slow every variant alike; medians and ratios to HF are printed.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.cpu.attach import attached_plan
from minivllm.cpu.matmul_forms import MatmulForm

PROMPT, NEW_TOKENS = "The capital of France is", 64


def main(rounds: int) -> None:
    torch.set_num_threads(2)
    llm = LLM(None, dtype="float32", device="cpu", enable_prefix_caching=False)
    plan = attached_plan(llm.llm_engine.model.lm_head_layer)  # measured at warm-up (cpu/attach.py)
    print(plan.summary())
    variants = {"measured": dict(plan.forms), "F.linear everywhere": {},
                "(W x^T)^T everywhere": {key: MatmulForm.WEIGHT_LEFT for key in plan.forms}}
    path = llm.llm_engine.config.model
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in [*variants, "HF generate"]}
    for round_ in range(rounds + 1):  # round 0 warms every variant up and is not counted
        for name, forms in variants.items():
            plan.forms = forms
            t0 = time.perf_counter()
            llm.generate(PROMPT, sp, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(**ids, do_sample=False, pad_token_id=tok.pad_token_id or 0, max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS)
            times["HF generate"].append(time.perf_counter() - t0)
    t_hf = statistics.median(times["HF generate"][1:])
    for name, ts in times.items():
        t = statistics.median(ts[1:])
        print(f"{name:22s} {NEW_TOKENS / t:6.1f} tok/s   {t_hf / t:.2f}x HF generate (median of {rounds})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    main(parser.parse_args().rounds)
