"""Hands-on 1 and 2: grading a paged-attention backend (plain torch) and its Triton kernel.

    check_backend_probes(MyBackend)         # the rules, one small batch each, against the reference
    check_backend_in_engine(MyBackend)      # then the real engine runs it: HF-exact tokens and logprobs
    KernelBackend(paged_attention, ...)     # a kernel function behind the same seam (assignment 2)

A backend is plugged in through the engine's seam: `LLM(model, attention_backend=MyBackend(...))`.
The probes come first because the engine's verdict ("token 3 differs from HF's") says nothing about
WHY. Each probe is one batch that adds one idea to the ones before it, so the first probe that fails
names the rule broken:

    1 basics         one decode row, one KV head per query head, a context of exactly one block
    2 GQA            query heads share KV heads: head h reads KV head h // (num_heads // num_kv_heads)
    3 online softmax three full blocks, read one at a time: a later block's larger score rescales the sums
    4 last block     a context whose last block holds one key: read it, and not the slots after it
    5 block table    blocks scattered over the pool: position p lives in block_tables[i][p // block_size]
    6 decode batch   several requests, a row each: each reads its own row of q and of block_tables
    7 causal         a prefill of several rows: each sees the keys up to its own position only
    8 chunk          rows after a cached prefix: they are the LAST query_len positions of the context
    9 mixed batch    prefill chunks and decode rows in one flat batch, each request its own context
   10 block size     the mixed batch again in blocks of 8: the block size is the pool's, not a constant
   11 head size      and with heads of 32: head_dim and the scale are the model's, not constants
   12 fp32 softmax   the mixed batch in bf16 with large scores: computed in fp32, rounded once at the end

Probes 1-9 use blocks of 4 and heads of 16 (the notebooks' sizes): a size written as a constant is named by 10 or
11. Each probe also checks what the backend writes: the new k/v at `slot_mapping` and nothing else in the pool (a
kernel's `KernelBackend` stores them; the kernel writes only its output), q, k and v unchanged; a kernel's torch
code outside its launch may not compute (teaching/host_ops.py). The expected: `naive_paged_attention` in fp32. Slots
no request owns hold junk, so reading one shows."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata
from minivllm.teaching.hands_on import AssignmentError, check_finished, tiny_model
from minivllm.teaching.host_ops import TorchOps
from minivllm.teaching.submission_rules import RULES, SubmissionRules
from minivllm.teaching.submission_watch import Watch

# fp32 over <= 64 keys, |v| < 6: rounding < 64 * 6 * 1.2e-7 ~ 5e-5 of the reference's; 1e-4 catches real mistakes
ATOL = 1e-4
KernelFn = Callable[..., torch.Tensor]  # paged_attention(q, k_cache, v_cache, block_tables, cu, ctx_lens, scale)


@dataclass(frozen=True)
class Probe:
    """One batch: per request (cached tokens, new rows); the rule its failure names."""

    name: str
    rule: str
    requests: tuple[tuple[int, int], ...]
    heads: tuple[int, int] = (4, 2)  # (num_heads, num_kv_heads)
    scattered: bool = True  # blocks taken from all over the pool (else request i's blocks are 0, 1, 2, ...)
    block_size: int = 4
    head_dim: int = 16
    dtype: torch.dtype = torch.float32  # of q, k, v and the pool
    scores_x: float = 1.0  # q and every key scaled by it: scores of ~36 where a bf16 score is off by ~0.1


MIXED_LONG = ((0, 9), (17, 1), (12, 3))  # a mixed batch whose contexts span blocks of 8 too
PROBES = (
    Probe("basics", "attention is softmax(q · kᵀ × scale) · v over every key of the request's context: a decode "
          "row is the LAST position of its context (context_len - 1), so it sees all context_len keys",
          ((3, 1),), heads=(2, 2), scattered=False),
    Probe("GQA", "query head h reads KV head h // (num_heads // num_kv_heads) (grouped-query attention)",
          ((3, 1),), scattered=False),
    Probe("online softmax", "online softmax: when a block raises the running max from m to m_new, everything summed "
          "under the old max (the weighted values acc AND the denominator l) is first rescaled by exp(m - m_new), so "
          "the result does not depend on how the keys are split into blocks", ((11, 1),), scattered=False),
    Probe("last block", "a context of n keys spans ceil(n / block_size) blocks, the last one partly filled: read "
          "its first slots up to the context's end, never the slots after it (another request's, or junk)",
          ((4, 1),), scattered=False),  # 5 keys: the last block holds 1 (a decode at pos % block_size == 0)
    Probe("block table", "position p's K/V live in physical block block_tables[i][p // block_size], at offset "
          "p % block_size: the blocks of a request are anywhere in the pool, in its table's order",
          ((9, 1),)),
    Probe("decode batch", "several requests in one step: request i's rows are q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] "
          "(q is a strided view: index it by its strides, or make it contiguous), and its keys come through its own "
          "row of block_tables", ((3, 1), (6, 1), (9, 1))),
    Probe("causal", "causal: the row at position p attends to keys 0 .. p only, never to a later row's",
          ((0, 7),)),
    Probe("chunk", "a request's rows are the LAST query_len positions of its context: row r sits at position "
          "context_len - query_len + r and attends to the cached prefix before it too (chunked prefill, "
          "prefix caching)", ((6, 5),)),
    Probe("mixed batch", "prefill chunks and decode rows side by side in one step: each request's rows attend to "
          "its own context only, through its own row of block_tables", ((0, 5), (9, 1), (4, 3), (2, 1), (0, 1))),
    Probe("block size", "the block size is the pool's (meta.block_size, kv_cache.shape[2]), never a constant: "
          "position p is in block_tables[i][p // block_size] at offset p % block_size for every block size",
          MIXED_LONG, block_size=8),
    Probe("head size", "the head size is the model's (self.head_dim, the cache's last dimension) and the scale "
          "self.scale = head_dim ** -0.5, never constants", MIXED_LONG, heads=(2, 1), head_dim=32),
    Probe("fp32 softmax", "scores, softmax and the weighted sum are computed in fp32 whatever q's dtype (the engine "
          "runs bf16): cast q, k and v up (.float()) and round the output to q's dtype once at the end; in bf16 a "
          "score of 36 is rounded by up to 0.125, its weight by 13%", MIXED_LONG, dtype=torch.bfloat16, scores_x=6.0),
)
BF16_RTOL, BF16_ATOL = 2.0 ** -7, 1e-3  # bf16 keeps 8 bits: one cast of the output is off <= 2^-8 |out| (2^-7 cut)
STORE_RULE = ("forward stores each new row's k and v at its slot, meta.slot_mapping (flat slot = block * "
              "block_size + offset), in kv_cache[0] and kv_cache[1], and writes nowhere else")
KERNEL_STORE_RULE = "the kernel reads k_cache and v_cache and writes only its output: the pool is the engine's"
INPUT_RULE = "forward changes none of q, k and v in place (q is a view of the model's projection: scale a copy)"
SHAPE_RULE = "forward returns a (num_tokens, num_heads * head_dim) tensor, one row per query row"


@dataclass
class Case:
    """One probe's inputs: q/k/v of the flat batch, the pool, the metadata."""

    q: torch.Tensor  # (T, Hq, D)
    k: torch.Tensor  # (T, Hkv, D)
    v: torch.Tensor  # (T, Hkv, D)
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hkv, D)
    meta: AttentionMetadata


def make_case(probe: Probe, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    block_size, head_dim = probe.block_size, probe.head_dim
    Hq, Hkv = probe.heads
    ctx_lens = [c + n for c, n in probe.requests]
    per_req = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(per_req) + 3  # spare blocks: junk a wrong index may land on
    order = torch.randperm(num_blocks, generator=g).tolist() if probe.scattered else list(range(num_blocks))
    tables, at = [], 0
    for nb in per_req:
        tables.append(order[at:at + nb])
        at += nb
    kv_cache = torch.randn(2, num_blocks, block_size, Hkv, head_dim, generator=g) * 2 + 3  # junk everywhere
    slots, rows = [], 0
    for (cached, n), table in zip(probe.requests, tables):
        flat = [table[p // block_size] * block_size + p % block_size for p in range(cached + n)]
        pool = kv_cache.view(2, -1, Hkv, head_dim)
        pool[:, flat[:cached]] = torch.randn(2, cached, Hkv, head_dim, generator=g)  # the cached prefix
        slots += flat[cached:]
        rows += n
    # Padded with 0 as the engine pads a batch's tables, and twice as wide: a kernel that assumes a smaller block
    # size reads entries past its request's; zeros keep those reads in the pool (a read past the tensor would
    # crash Triton's interpreter, not fail a probe).
    width = 2 * max(per_req) + 1
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_lens = [n for _, n in probe.requests]
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), cu, torch.tensor(ctx_lens, dtype=torch.int32),
                             block_tables, query_lens, ctx_lens, block_size)
    # As in the model, q, k and v are views into one projection's output: strided, not contiguous.
    qkv = torch.randn(rows, Hq + 2 * Hkv, head_dim, generator=g)  # (T, Hq + 2 Hkv, D)
    qkv[:, :Hq + Hkv], kv_cache[0] = qkv[:, :Hq + Hkv] * probe.scores_x, kv_cache[0] * probe.scores_x  # q and keys
    q, k, v = qkv.to(probe.dtype).split([Hq, Hkv, Hkv], dim=1)
    return Case(q, k, v, kv_cache.to(probe.dtype), meta)


def expected(case: Case, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pool after the store, the attention output (T, Hq * D)) by the reference."""
    from minivllm.kernels.paged_attention import naive_paged_attention

    cache = case.kv_cache.clone()
    Hkv, D = cache.shape[-2:]
    cache[0].view(-1, Hkv, D)[case.meta.slot_mapping] = case.k
    cache[1].view(-1, Hkv, D)[case.meta.slot_mapping] = case.v
    out = naive_paged_attention(case.q.float(), cache[0].float(), cache[1].float(), case.meta.block_tables,
                                case.meta.cu_seqlens_q, case.meta.context_lens, scale)  # fp32 whatever the dtype
    return cache, out.reshape(out.shape[0], -1)


def _fail(who: str, probe: Probe, rule: str, detail: str) -> AssignmentError:
    return AssignmentError(f"{who} broke a RULE: {rule}.\n  probe '{probe.name}': requests (cached, new rows) = "
                           f"{list(probe.requests)}, heads {probe.heads}, block_size {probe.block_size}, "
                           f"head_dim {probe.head_dim}; {detail}")


def check_backend_probes(make_backend: Callable[[int, int, int], AttentionBackend], *, check_store: bool = True,
                         rules: SubmissionRules | None = None, kernel_module: str | None = None) -> None:
    """Run every probe through `make_backend(num_heads, num_kv_heads, head_dim)`; raise `AssignmentError`
    naming the first rule broken. `rules`: the student's code, watched while it runs, may not call the
    engine's own implementation; `kernel_module`: it must launch a @triton.jit function defined there."""
    for probe in PROBES:
        backend = make_backend(*probe.heads, probe.head_dim)
        who = getattr(make_backend, "__name__", type(backend).__name__)  # the kernel's name, not its wrapper's
        case = make_case(probe)
        want_cache, want = expected(case, backend.scale)
        kv_cache = case.kv_cache.clone()
        meta = make_case(probe).meta  # a fresh copy: a backend may keep its plan in it
        qkv = torch.cat([case.q, case.k, case.v], dim=1)  # a copy of the same strided views: yours to change
        sizes = [case.q.shape[1], case.k.shape[1], case.v.shape[1]]  # Hq, Hkv, Hkv
        q, k, v = qkv.split(sizes, dim=1)
        given = qkv.clone()
        watch, ops = Watch(rules or RULES["attention"]), TorchOps() if kernel_module else None
        try:
            with watch, ops or nullcontext():
                backend.prepare(meta)
                got = backend.forward(q, k, v, kv_cache, meta)
        except NotImplementedError:
            raise
        except Exception as error:  # a crash on this probe's batch: named by the probe's rule, like a wrong answer
            watch.check(who)
            raise _fail(who, probe, probe.rule, f"your code raised {type(error).__name__}: {error}") from error
        watch.check(who)
        if kernel_module is not None:
            watch.check_own_kernel(who, kernel_module)
            ops.check(who)
        if not torch.equal(kv_cache, want_cache):
            wrong = (kv_cache != want_cache).any(-1).any(-1).view(2, -1).nonzero().tolist()[:6]
            raise _fail(who, probe, STORE_RULE if check_store else KERNEL_STORE_RULE, f"(keys=0/values=1, flat "
                        f"slot) differing: {wrong}, the step's slots were {case.meta.slot_mapping.tolist()}")
        if not torch.equal(qkv, given):
            changed = [n for n, a, b in zip("qkv", qkv.split(sizes, 1), given.split(sizes, 1)) if not torch.equal(a, b)]
            raise _fail(who, probe, INPUT_RULE, f"after forward, {' and '.join(changed)} differ from what was passed")
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise _fail(who, probe, SHAPE_RULE, f"expected {tuple(want.shape)}, got {shape}")
        low = probe.dtype != torch.float32  # then measured against what one rounding of the output allows
        tolerance = want.abs() * BF16_RTOL + BF16_ATOL if low else torch.full_like(want, ATOL)
        diff = (got.float() - want).abs().nan_to_num(float("inf"))  # (T, Hq * D)
        over = diff / tolerance  # > 1 fails
        if float(over.max()) > 1:
            worst = int(over.argmax())
            row, col = divmod(worst, want.shape[1])
            nan = " (your output has NaN)" if bool(got.isnan().any()) else ""
            raise _fail(who, probe, probe.rule, f"largest difference {float(diff.view(-1)[worst]):.3g} ("
                        f"{float(over.max()):.3g}x the tolerance) at row {row}, query head "
                        f"{col // probe.head_dim}{nan}")


class KernelBackend(AttentionBackend):
    """Assignment 2's kernel behind the seam: the K/V store in torch, then the student's
    `paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale) -> (T, Hq, D)`."""

    name = "hands-on-kernel"

    def __init__(self, kernel: KernelFn, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.kernel = kernel

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        Hkv, D = self.num_kv_heads, self.head_dim
        kv_cache[0].view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v)
        out = self.kernel(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                          self.scale)  # (T, Hq, D)
        return out.reshape(q.shape[0], self.num_heads * D) if isinstance(out, torch.Tensor) else out


def kernel_backend(kernel: KernelFn) -> Callable[[int, int, int], AttentionBackend]:
    def make(num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
        return KernelBackend(kernel, num_heads, num_kv_heads, head_dim)

    make.__name__ = getattr(kernel, "__name__", "kernel")
    return make


# Prompts for the engine run: short and long (chunked at 8 tokens a step), two sharing a 9-token prefix
# with one run before them (prefix-cache hits), and one of a single token.
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19]
ENGINE_BLOCK_SIZE = {"llama": 4, "qwen3": 8}  # two block sizes here too (the kernel's run is qwen3's)
ENGINE_PROMPTS = ([5, 6, 7], list(range(20, 41)), SHARED + [50, 51], SHARED + [60], [70])


def check_backend_in_engine(make_backend: Callable[[int, int, int], AttentionBackend],
                            families: tuple[str, ...] = ("llama", "qwen3"), max_tokens: int = 8) -> None:
    """The real engine on tiny random checkpoints with the backend in charge, chunked prefill (8 tokens a
    step), prefix-cache hits and decode, in blocks of 4 (llama) or 8 (qwen3): every greedy token is HF
    transformers' argmax (teacher-forced) and every returned logprob equals HF's log-softmax."""
    from minivllm import LLM, SamplingParams
    from minivllm.models.hf_config import load_model_spec
    from minivllm.teaching.checkpoints import load_hf_model
    from minivllm.teaching.hf_check import assert_hf_greedy

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    for family in families:
        model_dir = tiny_model(family)
        spec = load_model_spec(model_dir)
        backend = make_backend(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)
        who = f"{type(backend).__name__} (in the engine, tiny random {family})"
        llm = LLM(model_dir, dtype="float32", attention_backend=backend, block_size=ENGINE_BLOCK_SIZE[family],
                  num_kv_blocks=64, max_num_batched_tokens=8, warmup=False)
        hf = load_hf_model(model_dir)
        outs = llm.generate([{"prompt_token_ids": SHARED}], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": p} for p in ENGINE_PROMPTS], params, use_tqdm=False)
        check_finished(who, outs)
        if llm.get_stats().prefix_cache_hits == 0:
            raise AssignmentError(f"{who}: no prefix-cache hit happened, so chunks after a cached prefix were "
                                  "not tested (did the backend change block_tables?)")
        for prompt, out in zip([SHARED, *ENGINE_PROMPTS], outs):
            tokens = out.outputs[0].token_ids
            try:
                assert_hf_greedy(hf, prompt, tokens)
            except AssertionError as error:
                raise AssignmentError(f"{who} broke a RULE: the engine's greedy tokens are HF transformers' argmax "
                                      f"(teacher-forced) at every position; prompt of {len(prompt)} tokens: "
                                      f"{error}") from None
            with torch.no_grad():
                ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            for j, candidates in enumerate(out.outputs[0].logprobs):
                for token, lp in candidates.items():
                    if abs(lp.logprob - float(ref[j, token])) > 1e-3:
                        raise AssignmentError(f"{who} broke a RULE: the engine's logprobs are HF's log-softmax; output "
                                              f"{j} token {token}: {lp.logprob:.5f}, HF {float(ref[j, token]):.5f}")
