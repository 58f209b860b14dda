"""What int8 weights cost in quality: perplexity of the default model on a fixed text, per precision.

    python benchmarks/int8_quality.py [--text README.md] [--tokens 1024]

Teacher-forced through the engine (`prompt_logprobs`): the text's first `--tokens` tokens, the
log-probability each precision gives to every next token. Printed per precision: perplexity, its
change against fp32, and how often the argmax is the same token as fp32's (top-1 agreement).
int8 could become the default model's default only within 2 % of fp32's perplexity.
"""

from __future__ import annotations

import argparse
import math

import torch

from minivllm import LLM, SamplingParams

PRECISIONS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
              "int8 + fp32": dict(dtype="float32", quantization="int8"),
              "int8 + bf16": dict(dtype="bfloat16", quantization="int8")}


def main(text_path: str, num_tokens: int) -> None:
    torch.set_num_threads(2)
    results = {}
    for name, kwargs in PRECISIONS.items():
        llm = LLM(None, enable_prefix_caching=False, **kwargs)
        ids = llm.get_tokenizer()(open(text_path).read()).input_ids[:num_tokens]
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        positions = out.prompt_logprobs[1:]  # the first token has nothing before it
        nll = -sum(p[tok].logprob for p, tok in zip(positions, ids[1:])) / len(positions)
        top1 = [max(p.items(), key=lambda item: item[1].logprob)[0] for p in positions]
        results[name] = (math.exp(nll), top1)
        llm.shutdown()
    ppl0, top0 = results["fp32"]
    print(f"{text_path}, {len(top0) + 1} tokens, SmolLM2-135M-Instruct")
    for name, (ppl, top1) in results.items():
        agree = sum(a == b for a, b in zip(top1, top0)) / len(top0)
        print(f"  {name:12s} perplexity {ppl:7.3f} ({100 * (ppl / ppl0 - 1):+.2f}% vs fp32), "
              f"top-1 agreement with fp32 {100 * agree:.1f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="README.md")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    main(args.text, args.tokens)
