"""engine/worker/runner_builder.py: one factory builds every `ModelRunner`, and the samplers follow the attention
backend's type, never its name."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from minivllm import LLM
from minivllm.engine.spec_decode.rejection_sampler import RejectionSampler, TritonRejectionSampler
from minivllm.engine.worker.runner_builder import samplers_for
from minivllm.layers.sampler import Sampler, TritonSampler
from minivllm.layers.torch_attention import TorchAttentionBackend
from minivllm.layers.triton_attention import TritonAttentionBackend

ROOT = Path(__file__).resolve().parents[2]


def test_the_samplers_follow_the_backends_type_not_its_name():
    class NamedLikeTriton(TorchAttentionBackend):  # a backend of your own may call itself anything
        name = "triton"

    triton = TritonAttentionBackend(4, 2, 16, torch.device("cpu"), 16)  # the interpreter (tests/conftest.py)
    kinds = {type(b).__name__: tuple(type(s) for s in samplers_for(b))
             for b in (TorchAttentionBackend(4, 2, 16), NamedLikeTriton(4, 2, 16), triton)}
    assert kinds == {"TorchAttentionBackend": (Sampler, RejectionSampler),
                     "NamedLikeTriton": (Sampler, RejectionSampler),
                     "TritonAttentionBackend": (TritonSampler, TritonRejectionSampler)}


def test_only_the_factory_constructs_a_model_runner():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "minivllm").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bModelRunner\(", line)]
    assert found and all(f.startswith("minivllm/engine/worker/runner_builder.py:") for f in found), found


def test_the_draft_model_runner_is_built_like_the_targets(model_factory):
    """Same checkpoint as draft and target: the draft's runner has the target's pool plus its scratch blocks,
    the same sampler kind, no compiled sizes and no CUDA graphs."""
    path = model_factory("qwen3")
    with LLM(path, dtype="float32", block_size=4, num_kv_blocks=32, warmup=False, max_num_seqs=4,
             speculative_config={"model": path, "num_speculative_tokens": 3}) as llm:
        target = llm.llm_engine.model_runner
        draft = llm.llm_engine.speculator.proposer
        assert draft.runner.num_blocks == target.num_blocks + 4 * draft.scratch_per_seq
        assert type(draft.runner.sampler) is type(target.sampler) is Sampler
        assert draft.runner.compile_sizes == () and draft.runner.cuda_graphs is None
