"""The inner layers skip nn.Module.__call__ (layers/direct_call.py): a call is the layer's own forward,
hooks are refused rather than skipped, and a decode step makes no module call on them."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.distributed.parallel_state import ParallelContext
from minivllm.layers.linear import Linear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.parallel_linear import RowParallelLinear
from minivllm.models.llama import MLP

DIRECT = (Linear, RMSNorm, MLP)


def test_a_call_is_the_layers_own_forward_even_in_a_subclass(monkeypatch):
    class Doubled(Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    def no_module_call(self, *args, **kwargs):
        raise AssertionError(f"nn.Module.__call__ ran for {type(self).__name__}")

    monkeypatch.setattr(nn.Module, "_call_impl", no_module_call)
    x = torch.randn(2, 4)
    layer = Doubled(4, 3)
    torch.testing.assert_close(layer(x), 2 * Linear.forward(layer, x), rtol=0, atol=0)
    assert RowParallelLinear(4, 3, bias=True, plan=None, tp=ParallelContext())(x).shape == (2, 3)
    assert RMSNorm(4, 1e-6)(x).shape == (2, 4)
    with pytest.raises(AssertionError, match="nn.Module.__call__ ran for Linear"):
        nn.Linear(4, 3)(x)  # the control: torch's own layers still go through __call__


@pytest.mark.parametrize("register", ["register_forward_hook", "register_forward_pre_hook",
                                      "register_full_backward_hook", "compile"])
def test_hooks_and_a_compiled_call_are_refused_where_they_could_never_run(register):
    for layer in (Linear(4, 3), RMSNorm(4, 1e-6)):
        with pytest.raises(TypeError, match=f"{type(layer).__name__} is called straight through its forward"):
            getattr(layer, register)(lambda *a: None)
    nn.Linear(4, 3).register_forward_hook(lambda *a: None)  # torch's own layers keep their hooks


def test_a_decode_step_makes_no_module_call_on_the_inner_layers(model_factory, monkeypatch):
    llm = LLM(model_factory("qwen3"), block_size=4, num_kv_blocks=64, warmup=False)
    model = llm.llm_engine.model
    assert any(isinstance(m, DIRECT) for m in model.modules())
    called = collections.Counter()
    real = nn.Module._call_impl

    def counted(self, *args, **kwargs):
        called["direct" if isinstance(self, DIRECT) else type(self).__name__] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "_call_impl", counted)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert called["VocabParallelEmbedding"] > 0  # the control: a layer called as a module is counted
    assert called["direct"] == 0, called
    llm.shutdown()
