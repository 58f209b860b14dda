"""The PyTorch attention backend: paged attention from plain tensor ops + SDPA.

Per layer:
  1. store the step's new k/v:  k_cache.view(-1, Hkv, D)[slot_mapping] = k
  2. decode rows (query_len == 1), all at once: gather each request's blocks into a padded
     (Bd, Hkv, K, D) tensor and run one SDPA with a key-length mask -- or, on a CPU where warm-up
     measured it faster, minivllm's C++ kernel that reads the blocks in place
     (kernels/paged_decode_attention.py): no copy, no mask. With it, step 1 is minivllm's C++ copy
     loop too (kernels/kv_cache_write_cpu.py), and the timing covers both. The backend holds the
     switch (`decode_kernel`); warm-up measures and sets it (minivllm/cpu/decode_kernels.py);
  3. prefill chunks, one request at a time: gather its context from the cache (this is what makes
     cached prefixes and later chunks correct) and run SDPA with a causal mask shifted by the
     number of earlier tokens. A whole prompt with nothing cached before it is its own context:
     its k/v are used as they come, without the gather.

A sliding window W (`meta.sliding_window`) narrows both masks to keys p - W + 1 .. p; a prefill
chunk gathers only the blocks from its first query's window on, and the decode kernel gets W (it
then reads only the window's blocks). The gather + SDPA decode path gathers each row's window, from
the block holding its first key, and zeroes the keys before the window in that block as it zeroes those
past each context (masked, but a stale NaN times a weight of 0 is still NaN).

GQA without copying K/V: the G = Hq / Hkv query heads sharing a KV head are folded into the query
length, (T, Hq, D) -> (Hkv, G*T, D), so SDPA sees Hkv heads and K/V are never repeated.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from minivllm.kernels.kv_cache_write_cpu import kv_cache_write_cpu
from minivllm.kernels.paged_decode_attention import paged_decode_attention
from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata
from minivllm.layers.custom_op import KernelChoice, NotMeasured

DECODE_CANDIDATES = ("sdpa", "kernel")  # the first is the default (tuning off, no kernels built)
# "kernel": decode rows run minivllm's CPU kernel and K/V writes its memcpy loop (else gather + SDPA, index_copy_)
DECODE_SUBJECT = "decode attention and K/V writes"


class _Prefill(NamedTuple):
    row_start: int
    row_end: int
    blocks: torch.Tensor  # (num_blocks_used,) physical blocks of this request, from the one holding first_key
    context_len: int
    mask: torch.Tensor  # (G * q_len, context_len - first_key) bool, True = may attend
    first_key: int = 0  # the position of the first key gathered (> 0 only under a sliding window)


class _Plan(NamedTuple):
    all_decode: bool
    decode_rows: torch.Tensor | None  # (Bd,) token rows that are decodes (None when all are: rows 0 .. Bd-1)
    decode_block_tables: torch.Tensor | None  # (Bd, max_blocks)
    decode_mask: torch.Tensor | int | None  # (Bd, 1, 1, K) bool, or the one shared context length
    prefills: list[_Prefill]
    decode_lens: torch.Tensor | None = None  # (Bd,) int64: set when the decode rows run the CPU kernel
    decode_outside: torch.Tensor | None = None  # (P,) int64: the (row * K + key) positions outside each row's keys
    window: int = 0  # the CPU kernel's sliding window (0: none)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_sliding_window = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        # the C++ kernel or gather + SDPA for decode rows: set at warm-up (minivllm/cpu/decode_kernels.py)
        self.decode_kernel: KernelChoice = NotMeasured(DECODE_SUBJECT, DECODE_CANDIDATES[0])

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        G = self.num_heads // self.num_kv_heads
        bs, W = meta.block_size, meta.sliding_window
        cu = [0]
        for q in meta.query_lens:
            cu.append(cu[-1] + q)
        dec = [i for i, q in enumerate(meta.query_lens) if q == 1]
        decode_rows = decode_tables = decode_mask = decode_lens = decode_outside = None
        if dec:
            all_decode = len(dec) == len(meta.query_lens)  # then row i is request i: no index to build
            dec_t = None if all_decode else torch.tensor(dec, device=device)
            max_blocks = -(-max(meta.context_lens_host[i] for i in dec) // bs)
            lens_host = [meta.context_lens_host[i] for i in dec]
            tables = meta.block_tables[:, :max_blocks] if all_decode else meta.block_tables[dec_t, :max_blocks]
            if self.decode_kernel.used:  # the kernel walks the block tables itself: no mask, no gather index
                decode_tables = tables.int().contiguous()  # (Bd, nb)
                decode_lens = torch.tensor(lens_host, dtype=torch.int64)
            else:
                windowed = W is not None and max(lens_host) > W  # some row does not see all its keys
                keys = torch.arange(max_blocks * bs, device=device)[None, :]  # (1, K): key positions
                if windowed:  # gather each row's window only, from the block holding its first key
                    first = [max(0, n - W) // bs for n in lens_host]
                    width = max(-(-n // bs) - f for n, f in zip(lens_host, first))
                    first_t = torch.tensor(first, device=device)[:, None]  # (Bd, 1)
                    cols = (first_t + torch.arange(width, device=device)).clamp(max=tables.shape[1] - 1)
                    tables = tables.gather(1, cols)  # (Bd, width): past a context, repeats (masked, zeroed)
                    keys = first_t * bs + torch.arange(width * bs, device=device)  # (Bd, K)
                decode_tables = tables.long()  # (Bd, nb)
                if min(lens_host) == max(lens_host) and not windowed:  # e.g. a single stream: slice, no mask
                    decode_mask = lens_host[0]
                else:
                    lens = meta.context_lens if all_decode else meta.context_lens[dec_t]  # (Bd,)
                    inside = keys < lens[:, None]  # (Bd, K)
                    if windowed:
                        inside &= keys >= lens[:, None] - W
                    decode_mask = inside[:, None, None, :]  # (Bd, 1, 1, K)
                    decode_outside = (~inside).view(-1).nonzero()[:, 0]  # (P,): the rows `forward` zeroes
            if not all_decode:  # where the decode rows sit among the step's rows (all decode: 0 .. Bd-1)
                decode_rows = torch.tensor([cu[i] for i in dec], device=device)
        prefills = []
        for i, q in enumerate(meta.query_lens):
            if q == 1:
                continue
            ctx = meta.context_lens_host[i]
            first = 0 if W is None else max(0, ctx - q - W + 1) // bs * bs  # the first query's window, from its block
            blocks = meta.block_tables[i, first // bs: -(-ctx // bs)].long()
            pos = torch.arange(ctx - q, ctx, device=device)  # absolute positions of the queries
            keys = torch.arange(first, ctx, device=device)
            allowed = keys[None, :] <= pos[:, None]  # (q, ctx - first): causal
            if W is not None:
                allowed &= keys[None, :] > pos[:, None] - W
            prefills.append(_Prefill(cu[i], cu[i + 1], blocks, ctx, allowed.repeat(G, 1), first))
        meta.plan = _Plan(len(dec) == len(meta.query_lens), decode_rows, decode_tables, decode_mask, prefills,
                          decode_lens, decode_outside, W or 0)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = q.shape[0]
        Hkv, D = self.num_kv_heads, self.head_dim
        G = self.num_heads // Hkv
        plan = meta.plan
        assert isinstance(plan, _Plan), "prepare(meta) must run before forward: meta.plan is not this backend's"

        k_cache, v_cache = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, Hkv, D) each
        bs = k_cache.shape[1]
        # --- store new K/V into their slots (with the CPU kernels chosen, by their memcpy loop) ---
        if self.decode_kernel.used:
            kv_cache_write_cpu(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v)

        # --- decode rows: the CPU kernel over the cache in place, or one padded SDPA call ---
        od = None  # (Bd, Hq*D): the decode rows' output
        if plan.decode_lens is not None:
            Bd = plan.decode_block_tables.shape[0]
            qd = q[:Bd] if plan.all_decode else q[plan.decode_rows]  # (Bd, Hq, D)
            od = paged_decode_attention(qd, k_cache, v_cache, plan.decode_block_tables, plan.decode_lens,
                                        self.scale, plan.window).reshape(Bd, self.num_heads * D)
        elif plan.decode_block_tables is not None:
            Bd, nb = plan.decode_block_tables.shape
            # Gather each request's blocks: index_select along dim 0 of the contiguous K (and V) pool is a
            # row memcpy; along any other dim PyTorch takes a generic path measured 10-20x slower on CPU.
            flat = plan.decode_block_tables.view(-1)
            kd = k_cache.index_select(0, flat)  # (Bd * nb, bs, Hkv, D): our own copy
            vd = v_cache.index_select(0, flat)
            if plan.decode_outside is not None:
                # Past each context lie a block's unwritten tail and padding blocks: whatever an earlier request
                # (or a failed step) left there, NaN included. SDPA's mask keeps those keys out of the softmax,
                # but a weight of 0 times a NaN value is NaN: zero those rows by selection, only those (a pass
                # over the whole copy doubled this path's time).
                kd.view(Bd * nb * bs, Hkv * D).index_fill_(0, plan.decode_outside, 0)
                vd.view(Bd * nb * bs, Hkv * D).index_fill_(0, plan.decode_outside, 0)
            kd = kd.view(Bd, nb * bs, Hkv, D).transpose(1, 2)  # (Bd, Hkv, K, D)
            vd = vd.view(Bd, nb * bs, Hkv, D).transpose(1, 2)
            mask = plan.decode_mask
            if isinstance(mask, int):  # every row has the same context: cut the padding instead
                kd, vd, mask = kd[:, :, :mask], vd[:, :, :mask], None
            qd = q[:Bd] if plan.all_decode else q[plan.decode_rows]  # all decode: rows 0..Bd-1
            qd = qd.view(Bd, Hkv, G, D)  # the G query heads of a KV head become G "query rows"
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=self.scale)
            od = od.reshape(Bd, self.num_heads * D)  # (Bd, Hkv, G, D) -> (Bd, Hq*D)
        if od is not None and plan.all_decode and od.shape[0] == T:
            return od  # a decode step: done, nothing else to write

        # Rows past the requests' own (padding for a compiled step: models/compiled_forward.py) get zeros.
        out = q.new_empty(T, self.num_heads * D) if T == meta.num_tokens else q.new_zeros(T, self.num_heads * D)
        if od is not None and plan.all_decode:  # rows 0 .. Bd-1, then the padding
            out[:od.shape[0]] = od
        elif od is not None:
            out.index_copy_(0, plan.decode_rows, od)

        # --- prefill chunks: one SDPA per request, causal mask shifted by the cached prefix ---
        for p in plan.prefills:
            n = p.row_end - p.row_start
            if p.context_len == n:  # nothing before these tokens: the context is this step's k/v
                kp = k[p.row_start:p.row_end].transpose(0, 1)  # (Hkv, ctx, D)
                vp = v[p.row_start:p.row_end].transpose(0, 1)
            else:
                n_keys = p.context_len - p.first_key
                kp = k_cache.index_select(0, p.blocks).view(-1, Hkv, D)[:n_keys].transpose(0, 1)
                vp = v_cache.index_select(0, p.blocks).view(-1, Hkv, D)[:n_keys].transpose(0, 1)
            qp = q[p.row_start:p.row_end].view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
            # A leading batch dim of 1: with 4-D inputs PyTorch's CPU SDPA takes its flash kernel; with
            # 3-D it falls back to the unfused math path (measured 1.5-2.5x slower for 16-128 tokens).
            op = F.scaled_dot_product_attention(qp[None], kp[None], vp[None], attn_mask=p.mask, scale=self.scale)
            out[p.row_start:p.row_end] = op.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, -1)
        return out
