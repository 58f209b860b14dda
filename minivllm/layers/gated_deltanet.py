"""Gated DeltaNet: linear attention whose memory is a fixed-size matrix instead of a growing KV cache.

Why a fixed-size state
----------------------
Softmax attention must keep every past key and value, because softmax(q . k_s) cannot be factored:
its KV cache grows by one row per token. Linear attention drops the softmax, and then the past folds
into one matrix per head: o_t = sum_s (q_t . k_s) v_s = S_t^T q_t with S_t = sum_s k_s v_s^T, of shape
(head_k_dim, head_v_dim) whatever the context length. So a request carries, per linear-attention layer,
    * the recurrent state S:  (num_v_heads, head_k_dim, head_v_dim)
    * the short-conv window:  (conv_dim, kernel_size - 1), the last inputs of the causal depthwise
                              convolution that runs over the projected q|k|v channels first.
Decode costs the same at token 10 and token 100 000, and there is nothing to page: a request owns one
slot of a state pool instead of a list of blocks (see `linear_attn_metadata.py`).

The gated delta rule (Yang et al. 2024, "Gated Delta Networks"; Qwen3-Next, Qwen3.5)
-------------------------------------------------------------------------------------
A plain sum S += k v^T only ever adds. The delta rule first reads what S already stores for k_t and
writes only the correction; the gate a_t = exp(g_t), g_t <= 0, lets old memories fade. Per head:

    S = initial_state                              # (Dk, Dv); zeros for a new request
    for t in tokens:
        S = exp(g_t) * S                           # forget a little
        delta = beta_t * (v_t - S^T k_t)           # (Dv,) the error of S's answer for key k_t
        S = S + outer(k_t, delta)                  # write the correction; beta_t in (0, 1) is a step size
        o_t = S^T (scale * q_t)                    # read with the query
    final_state = S

q and k arrive L2-normalised (the caller does it), so each write is a partial projection that cannot
blow S up. Grouped value heads: Hv may be a multiple of Hk; q/k head h serves value heads
h*G .. h*G + G-1 (G = Hv // Hk), as in HF and flash-linear-attention.

The chunked form: the same computation, as matmuls
-------------------------------------------------
A prefill of n tokens would run the loop n times. Within a chunk of C tokens starting from state S, write
Gamma_t = exp(g_1 + ... + g_t) (decay since the chunk start) and D[t, s] = Gamma_t / Gamma_s for s <= t
(0 above the diagonal). Unrolling the loop, each correction delta_t depends on the earlier ones only
linearly, so all of them solve one lower-triangular system:

    (I + L) delta = beta v - (beta Gamma k) S,        L = strictly_lower(beta_t (k_t . k_s) D[t, s])
    delta = U - W S,   U = (I + L)^-1 beta v,  W = (I + L)^-1 beta Gamma k     # one triangular solve
    O  = (Gamma q) S + ((q k^T) * D) delta             # read the old state + attend inside the chunk
    S' = Gamma_C S + (k * Gamma_C / Gamma)^T delta     # decayed old state + the chunk's writes

This is algebra, not an approximation: only S crosses a chunk boundary, so a prompt cut into chunks of
any size, with S carried between them, gives what one pass gives (up to rounding). Chunked prefill in
the engine relies on exactly that. Ratios of Gamma are computed as exp(difference), never divided.
Chunks end at multiples of chunk_size in the request's own positions (`starts`), so a prompt resumed
at such a multiple is cut exactly as one pass over it would be.

Snapshots (prefix caching, engine/core/state_cache.py): S at a chunk's end is the state after that token,
so asking for the states at some offsets only adds those offsets to the cuts. The engine asks for
multiples of its `state_cache_stride`, which is a multiple of chunk_size: no extra cut in practice.

Invariant: nothing here writes into a tensor it was given. New states are returned as new tensors;
the engine publishes them into its pool only when the step commits. All arithmetic is in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # (..., D) -> (..., D)
    """x / |x| over the last dim, in flash-linear-attention's (and HF's) exact form."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:  # (..., Hk, D) -> (..., Hv, D)
    return x.repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def _group_bounds(cu_seqlens: list[int]) -> list[tuple[int, int]]:
    return list(zip(cu_seqlens[:-1], cu_seqlens[1:]))


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop body above, for N independent rows at once (one token of N requests).
    state (N, H, Dk, Dv); q, k (N, H, Dk); v (N, H, Dv); g, beta (N, H) -> out (N, H, Dv), new state."""
    state = state * g.exp()[..., None, None]  # a new tensor: the caller's state is untouched
    delta = beta[..., None] * (v - torch.einsum("nhkv,nhk->nhv", state, k))  # (N, H, Dv)
    state = state + k[..., :, None] * delta[..., None, :]  # + outer(k, delta)
    return torch.einsum("nhkv,nhk->nhv", state, q * scale), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: list[int],
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The token loop over a varlen batch: request i owns rows cu_seqlens[i]:cu_seqlens[i+1] (a host list).
    Step t advances every request that has a t-th token, so a decode batch (one token each) is a
    single vectorised step.
    q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv); initial_state (N, Hv, Dk, Dv)
    -> out (T, Hv, Dv) in v's dtype, final_state (N, Hv, Dk, Dv) float32."""
    Hv = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = _expand_heads(q.float(), Hv), _expand_heads(k.float(), Hv)  # (T, Hv, Dk)
    state = initial_state.float()
    bounds = _group_bounds(cu_seqlens)
    if all(e - s == 1 for s, e in bounds):  # decode: row i is request i's only token, one step for all
        out, state = gated_delta_step(state, q, k, v.float(), g.float(), beta.float(), scale)
        return out.to(v.dtype), state
    out = v.new_empty(v.shape, dtype=torch.float32)  # (T, Hv, Dv)
    for t in range(max((e - s for s, e in bounds), default=0)):
        live = [i for i, (s, e) in enumerate(bounds) if s + t < e]  # requests with a t-th token
        rows = torch.tensor([bounds[i][0] + t for i in live], device=v.device)
        idx = torch.tensor(live, device=v.device)
        o, new = gated_delta_step(state[idx], q[rows], k[rows], v[rows].float(), g[rows].float(),
                                  beta[rows].float(), scale)
        state = state.index_copy(0, idx, new)  # out of place: a new tensor each step
        out[rows] = o
    return out.to(v.dtype), state


def _chunk(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one request, every head at once (the formulas of the module docstring).
    state (H, Dk, Dv); q (scaled), k (H, C, Dk); v (H, C, Dv); g, beta (H, C) -> out (H, C, Dv), state."""
    C, Dv = q.shape[1], v.shape[-1]
    log_gamma = g.cumsum(-1)  # (H, C): log Gamma_t
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # D[t, s] = Gamma_t / Gamma_s for s <= t; masked before exp so the upper triangle cannot overflow
    decay = (log_gamma[:, :, None] - log_gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # (H, C, C)
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # L, strictly lower
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    gamma = log_gamma.exp()[..., None]  # (H, C, 1)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * gamma * k], dim=-1)  # (H, C, Dv + Dk)
    U, W = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True).split(
        [Dv, k.shape[-1]], dim=-1)
    delta = U - W @ state  # (H, C, Dv): every correction of the chunk
    out = (gamma * q) @ state + ((q @ k.transpose(-1, -2)) * decay) @ delta  # (H, C, Dv)
    to_end = (log_gamma[:, -1:] - log_gamma).exp()[..., None]  # (H, C, 1): Gamma_C / Gamma_t
    new_state = log_gamma[:, -1].exp()[:, None, None] * state + (k * to_end).transpose(-1, -2) @ delta
    return out, new_state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: list[int],
                           chunk_size: int = 64, scale: float | None = None, starts: list[int] | None = None,
                           snapshot_offsets: list[list[int]] | None = None,
                           snapshots: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over a varlen batch: a loop over requests, then over chunks of each request
    (the last chunk may be short; there is no padding). Same arguments and results as
    `recurrent_gated_delta_rule`; for prefill chunks. `starts[i]`: the position of request i's first
    row (default 0), which places the chunk cuts. With `snapshot_offsets`, the state after the first
    o rows of request i, for each o in snapshot_offsets[i] (1 <= o <= its rows), is appended to
    `snapshots` as an (Hv, Dk, Dv) float32 tensor, request by request, offsets in order."""
    Hv = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = _expand_heads(q.float() * scale, Hv).transpose(0, 1)  # (Hv, T, Dk): heads first for batched matmuls
    k = _expand_heads(k.float(), Hv).transpose(0, 1)
    v32, g, beta = v.float().transpose(0, 1), g.float().t(), beta.float().t()  # (Hv, T, Dv), (Hv, T)
    out = torch.empty_like(v32)  # (Hv, T, Dv)
    finals = []
    for i, (s, e) in enumerate(_group_bounds(cu_seqlens)):
        state = initial_state[i].float()  # (Hv, Dk, Dv)
        first_cut = s + chunk_size - (starts[i] if starts else 0) % chunk_size  # the next multiple of chunk_size
        keep = {s + o for o in snapshot_offsets[i]} if snapshot_offsets else set()
        lo = s
        for hi in sorted({*range(first_cut, e, chunk_size), *keep, e}):
            out[:, lo:hi], state = _chunk(state, q[:, lo:hi], k[:, lo:hi], v32[:, lo:hi], g[:, lo:hi],
                                          beta[:, lo:hi])
            if hi in keep:
                snapshots.append(state)
            lo = hi
        finals.append(state)
    return out.transpose(0, 1).to(v.dtype), torch.stack(finals)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: list[int],
                  snapshot_offsets: list[list[int]] | None = None, snapshots: list[torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over a varlen batch, continuing each request's window.
    Output row t of a request mixes its inputs t-K+1 .. t; the K-1 inputs before the first row come
    from `conv_state` (zeros for a new request), so cutting a prompt into chunks changes nothing.
    x (T, C); weight (C, K); conv_state (N, C, K-1) -> out (T, C), new conv_state (N, C, K-1):
    each request's last K-1 inputs, reaching into the old window when it has fewer new rows than K-1.
    `snapshot_offsets` / `snapshots`: as in `chunk_gated_delta_rule`, the (C, K-1) window after o rows."""
    K = weight.shape[-1]
    out = torch.empty_like(x)
    new_states = []
    for i, (s, e) in enumerate(_group_bounds(cu_seqlens)):
        window = torch.cat([conv_state[i].to(x.dtype), x[s:e].t()], dim=-1)  # (C, K-1 + n)
        y = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # (C, n), no padding
        out[s:e] = F.silu(y).t()
        new_states.append(window[:, -(K - 1):])
        for o in snapshot_offsets[i] if snapshot_offsets else ():  # window column K-1+r holds row r
            snapshots.append(window[:, o:o + K - 1])
    return out, torch.stack(new_states)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode case of `causal_conv1d`: one new row per request, all requests at once.
    x (N, C); weight (C, K); conv_state (N, C, K-1) -> out (N, C), new conv_state (N, C, K-1)."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # (N, C, K): old inputs, then x
    y = (window.float() * weight.float()).sum(-1).to(x.dtype)  # accumulate in fp32, as conv1d does
    return F.silu(y), window[:, :, 1:]
