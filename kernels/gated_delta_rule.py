"""The gated delta rule's recurrent update (decode) as one Triton kernel, reading states from a slot pool.

A gated-DeltaNet layer keeps one matrix S per request and value head instead of a KV cache (why, and the
chunked prefill form: minivllm/layers/gated_deltanet.py). Decode advances S by one token:

    for each request n, value head h:                              # one program per V-tile of S
        S = state_pool[slot[n], h] if slot[n] >= 0 else 0          # (Dk, Dv), float32
        for t in request n's rows cu_seqlens[n] .. cu_seqlens[n+1]:    # usually one row (decode)
            hk = h // (Hv // Hk)                                    # grouped value heads share q/k
            S = exp(g[t, h]) * S                                    # decay
            delta = beta[t, h] * (v[t, h] - S^T k[t, hk])           # (Dv,) the correction
            S = S + outer(k[t, hk], delta)                          # write it
            o[t, h] = S^T (scale * q[t, hk])                        # read
        final_state[n, h] = S                                       # a NEW tensor: the pool is only read

Grid: (num_requests, num_v_heads, cdiv(Dv, BLOCK_V)). The columns of S never mix: column j's update
needs only q, k, g, beta and column j itself (delta_j = beta (v_j - S[:, j] . k)), so a program owns a
(Dk, BLOCK_V) tile of S, keeps it in registers across the request's rows, and reads and writes the
state exactly once:

    state_pool (num_slots, Hv, Dk, Dv)                 final_state (N, Hv, Dk, Dv)
      slot[n] --> head h --> [ Dk x | BV | BV | BV ]  ===> program (n, h, jb) ===>  [ Dk x | BV | .. ]
                                     tile jb                    rows of n

Writing out of place is the engine's transaction rule: a step's new states are published only when it
commits, so a failed step must leave the pool as it found it. q and k arrive L2-normalised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def naive_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, state_pool: torch.Tensor, state_slots: torch.Tensor,
                                     cu_seqlens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference, one request, head and token at a time, exactly the docstring's loop.
    q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv); state_pool (P, Hv, Dk, Dv); state_slots (N,) with
    -1 = start from zeros; cu_seqlens (N + 1,) -> out (T, Hv, Dv), final_state (N, Hv, Dk, Dv) float32."""
    Hk, Hv = k.shape[1], v.shape[1]
    out = torch.empty_like(v)
    finals = []
    for n in range(state_slots.numel()):
        slot = int(state_slots[n])
        S = state_pool[slot].float().clone() if slot >= 0 else state_pool.new_zeros(state_pool.shape[1:],
                                                                                     dtype=torch.float32)
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            for h in range(Hv):
                hk = h // (Hv // Hk)
                qt, kt = q[t, hk].float(), k[t, hk].float()  # (Dk,)
                S[h] = S[h] * g[t, h].float().exp()
                delta = beta[t, h].float() * (v[t, h].float() - S[h].t() @ kt)  # (Dv,)
                S[h] = S[h] + torch.outer(kt, delta)
                out[t, h] = (S[h].t() @ (scale * qt)).to(v.dtype)
        finals.append(S)
    return out, torch.stack(finals)


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # (T, Hk, Dk), (T, Hk, Dk), (T, Hv, Dv), (T, Hv), (T, Hv)
    pool_ptr, slots_ptr, cu_ptr,  # state pool (P, Hv, Dk, Dv); (N,) slot or -1; (N + 1,) row offsets
    out_ptr, final_ptr,  # (T, Hv, Dv); (N, Hv, Dk, Dv) float32, written here
    scale,  # applied to q (1 / sqrt(Dk) by default)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,  # token / head strides (last dims: 1)
    stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ps, stride_ph, stride_pk,  # pool: slot / head / key-row strides
    stride_ot, stride_oh, stride_fn, stride_fh, stride_fk,
    GROUP: tl.constexpr,  # Hv // Hk: value heads per q/k head
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    jb = tl.program_id(2)
    hk = h // GROUP
    rows = tl.arange(0, BLOCK_K)  # key dims, padded to a power of two
    cols = jb * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value columns
    row_ok = rows < DK
    col_ok = cols < DV
    tile_ok = row_ok[:, None] & col_ok[None, :]

    # --- load the starting tile of S (zeros for a request that starts now) ---
    slot = tl.load(slots_ptr + n).to(tl.int64)
    src = pool_ptr + tl.maximum(slot, 0) * stride_ps + h * stride_ph + rows[:, None] * stride_pk + cols[None, :]
    S = tl.load(src, mask=tile_ok, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_V); slot -1 reads slot 0...
    S = tl.where(slot >= 0, S, 0.0)  # ...and drops it (a select, not a multiply: a stale slot may hold NaN)

    # --- the recurrence over the request's rows ---
    start = tl.load(cu_ptr + n).to(tl.int64)  # int64 row offsets: T * stride may pass 2^31
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    for t in range(start, end):
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + rows, mask=row_ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + rows, mask=row_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + h * stride_bh).to(tl.float32)
        S = S * tl.exp(g)  # decay
        delta = beta * (v - tl.sum(S * k[:, None], axis=0))  # (BLOCK_V,) the correction
        S = S + k[:, None] * delta[None, :]  # write
        o = tl.sum(S * (q * scale)[:, None], axis=0)  # (BLOCK_V,) read
        tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, o.to(out_ptr.dtype.element_ty), mask=col_ok)

    # --- publish the final tile, out of place ---
    dst = final_ptr + n * stride_fn + h * stride_fh + rows[:, None] * stride_fk + cols[None, :]
    tl.store(dst, S, mask=tile_ok)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, state_pool: torch.Tensor, state_slots: torch.Tensor,
                                    cu_seqlens: torch.Tensor, scale: float, block_v: int = 32
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as `naive_recurrent_gated_delta_rule`. `block_v` caps the value
    columns per program (a power of two)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    N = state_slots.numel()
    assert Hv % Hk == 0, "value heads must be a multiple of q/k heads"
    for name, x in (("q", q), ("k", k), ("v", v), ("state_pool", state_pool)):
        assert x.stride(-1) == 1, f"{name}'s last dim must be contiguous (the kernel steps it by 1)"
    out = torch.empty_like(v)
    final = torch.empty(N, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    if N == 0:
        return out, final
    block_v = min(block_v, triton.next_power_of_2(Dv))
    grid = (N, Hv, triton.cdiv(Dv, block_v))
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state_pool, state_slots, cu_seqlens, out, final, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        out.stride(0), out.stride(1), final.stride(0), final.stride(1), final.stride(2),
        GROUP=Hv // Hk, DK=Dk, DV=Dv, BLOCK_K=triton.next_power_of_2(Dk), BLOCK_V=block_v,
    )
    return out, final
