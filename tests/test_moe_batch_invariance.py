"""Batch invariance for a mixture of experts (layers/batch_invariance.py `TiledMoeMethod`): a token's output has
the same bits whichever tokens share its step, and equals the plain reference (`naive_fused_moe`) up to rounding;
the engine's mode gives every FusedMoE the method. The engine end to end is in tests/test_moe_engine.py."""

from __future__ import annotations

import pytest
import torch
from moe_helpers import tiny_moe_checkpoint

from minivllm import LLM
from minivllm.kernels.fused_moe import naive_fused_moe
from minivllm.layers.batch_invariance import TiledLinearMethod, TiledMoeMethod
from minivllm.layers.fused_moe import FusedMoE
from minivllm.layers.moe_router import select_experts

E, K, H, I = 8, 2, 64, 48


def moe_layer(dtype: torch.dtype) -> FusedMoE:
    g = torch.Generator().manual_seed(0)
    layer = FusedMoE(E, K, H, I, renormalize=True)
    layer.w13_weight.data = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    layer.w2_weight.data = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    layer.moe_method = TiledMoeMethod()
    return layer


# bf16 is checked against the reference only, not for equal bits: on the CPU this was written on (oneDNN's
# bf16 GEMM, one thread) F.linear's bits did not depend on the row count at any shape tried (H up to 1024, up to
# 2048 rows), so the untiled TorchMoeMethod passed the bit check too: it could not tell. In fp32 it fails.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_has_the_same_bits_in_any_batch_and_matches_the_reference(dtype):
    layer = moe_layer(dtype)
    g = torch.Generator().manual_seed(1)
    router = torch.randn(H, E, generator=g)
    token = torch.randn(1, H, generator=g).to(dtype)
    with torch.no_grad():
        alone = layer(token, token.float() @ router)  # (1, H): one row for each of its K experts
        for rows in (2, 3, 9, 17, 40):  # its experts serve 1 to ~rows*K/E+1 rows: other products' M
            batch = torch.randn(rows, H, generator=g).to(dtype)
            for at in {0, rows // 2, rows - 1}:
                batch[at] = token[0]
                logits = batch.float() @ router  # (rows, E)
                out = layer(batch, logits)
                if dtype == torch.float32:
                    assert torch.equal(out[at], alone[0]), f"row {at} of {rows}"
                weights, ids = select_experts(logits, K, renormalize=True)
                ref = naive_fused_moe(batch, layer.w13_weight, layer.w2_weight, weights, ids)  # (rows, H)
                tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out, ref, **tol)


def test_the_mode_gives_every_expert_layer_the_tiled_method(tmp_path):
    path = tiny_moe_checkpoint(tmp_path, "qwen2_moe")  # a shared expert and its gate: Linears, tiled too
    # warmed up: the CPU's packed MoE method (cpu/attach.py) must not replace the tiled one
    model = LLM(str(path), dtype="float32", batch_invariant=True, num_kv_blocks=16).llm_engine.model
    experts = model.expert_layers()
    assert experts and all(isinstance(m.moe_method, TiledMoeMethod) for m in experts)
    linears = [m for m in model.modules() if hasattr(m, "quant_method")]
    assert all(isinstance(m.quant_method, TiledLinearMethod) for m in linears)
    assert any(name.endswith("shared_expert_gate") for name, m in model.named_modules() if m in linears)
