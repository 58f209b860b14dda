"""The seams a student's code plugs into, through `LLM`: an attention backend and a sampling filter of one's
own, and the config and the CLI with objects in their fields. Each re-implementation of the default gives the
default engine's tokens (greedy and seeded sampling), each is really used, and what cannot work is refused
naming the field. The block allocator's seam: tests/engine/test_block_allocator.py; the scheduling policy's:
test_crossed_paths.py and the scheduler's machine (tests/engine/test_scheduler.py)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.engine.core.block_allocator import LRUAllocator
from minivllm.layers.attention_interface import AttentionBackend, AttentionMetadata
from minivllm.layers.sampler import FilterContractError, SamplingFilter, SamplingTensors, TopKTopPMinP
from minivllm.layers.torch_attention import TorchAttentionBackend
from minivllm.models.hf_config import load_model_spec

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9] * 6, list(range(20, 37)), [40, 41, 42, 43, 44])]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0.9, top_k=k, top_p=p, min_p=m, seed=100 + i, max_tokens=10, ignore_eos=True)
           for i, (k, p, m) in enumerate([(0, 1.0, 0.0), (20, 1.0, 0.0), (0, 0.8, 0.0), (50, 0.9, 0.05)])]


def tiny(model_factory, **kwargs) -> LLM:
    return LLM(model_factory("qwen3"), warmup=False, **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


def run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def default_tokens(model_factory) -> dict[str, list[list[int]]]:
    llm = tiny(model_factory)
    return {"greedy": run(llm, GREEDY), "sampled": run(llm, SAMPLED)}


def heads(model_factory) -> tuple[int, int, int]:
    spec = load_model_spec(model_factory("qwen3"))
    return spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim


# --- attention backend ----------------------------------------------------------------------------------
class NaiveAttention(AttentionBackend):
    """Paged attention the plain way: store the new K/V at their slots, then one request at a time, gather
    its context through its block table and take a causal softmax."""

    name = "naive"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        Hkv, D, G = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        bs = meta.block_size
        kv_cache[0].view(-1, Hkv, D)[meta.slot_mapping] = k
        kv_cache[1].view(-1, Hkv, D)[meta.slot_mapping] = v
        out = q.new_zeros(q.shape[0], self.num_heads * D)
        row = 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            blocks = meta.block_tables[i, :-(-ctx // bs)].long()
            keys = kv_cache[0][blocks].reshape(-1, Hkv, D)[:ctx].repeat_interleave(G, dim=1)  # (ctx, Hq, D)
            values = kv_cache[1][blocks].reshape(-1, Hkv, D)[:ctx].repeat_interleave(G, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[row:row + n], keys) * self.scale  # (Hq, n, ctx)
            positions = torch.arange(ctx - n, ctx, device=q.device)  # the query rows' positions
            future = torch.arange(ctx, device=q.device)[None, :] > positions[:, None]  # (n, ctx)
            weights = scores.masked_fill(future, float("-inf")).softmax(-1)
            out[row:row + n] = torch.einsum("hqk,khd->qhd", weights, values).reshape(n, -1)
            row += n
        return out


def test_the_default_backend_as_an_instance_gives_the_default_tokens(model_factory, default_tokens):
    backend = TorchAttentionBackend(*heads(model_factory))
    llm = tiny(model_factory, attention_backend=backend)
    assert llm.llm_engine.model_runner.backend is backend  # used as given
    assert run(llm, GREEDY) == default_tokens["greedy"]
    assert run(llm, SAMPLED) == default_tokens["sampled"]


def test_a_backend_written_from_scratch_gives_the_default_greedy_tokens(model_factory, default_tokens):
    llm = tiny(model_factory, attention_backend=NaiveAttention(*heads(model_factory)))
    assert run(llm, GREEDY) == default_tokens["greedy"]


def test_a_backend_is_refused_with_tensor_parallelism_or_the_wrong_heads(model_factory):
    num_heads, num_kv_heads, head_dim = heads(model_factory)
    with pytest.raises(ValueError, match="attention_backend=TorchAttentionBackend.*tensor_parallel_size=2"):
        EngineConfig(model="m", tensor_parallel_size=2, attention_backend=TorchAttentionBackend(4, 2, 16))
    with pytest.raises(ValueError, match=f"attention_backend=NaiveAttention.*num_heads={num_heads}, num_kv_heads="
                                         f"{num_kv_heads}, head_dim={head_dim}: build the backend with those"):
        tiny(model_factory, attention_backend=NaiveAttention(num_heads, num_kv_heads, head_dim * 2))
    with pytest.raises(ValueError, match="attention_backend=TorchAttentionBackend.*with a draft model"):
        EngineConfig(model="m", attention_backend=TorchAttentionBackend(4, 2, 16),
                     speculative_config={"model": model_factory("qwen3"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="attention_backend='flash' is invalid"):
        EngineConfig(model="m", attention_backend="flash")


# --- sampling filter ------------------------------------------------------------------------------------
class RowByRowFilter(SamplingFilter):
    """The default's top-k, top-p and min-p, re-derived one row at a time."""

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        out = logits.clone()
        for r, row in enumerate(out):  # each row a view into `out`
            k, p, m = int(sampling.top_ks[r]), sampling.top_ps[r], sampling.min_ps[r]
            if k < row.numel():
                row[row < row.topk(k).values[-1]] = float("-inf")
            if p < 1:
                ranked, order = row.sort(descending=True)
                probs = ranked.softmax(-1)
                row[order[probs.cumsum(-1) - probs >= p]] = float("-inf")  # mass ranked above reaches p
            if m > 0:
                probs = row.softmax(-1)
                row[probs < m * probs.max()] = float("-inf")
        return out


class KeepTheTop(SamplingFilter):
    """Every row keeps its most likely token only: sampling becomes greedy."""

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        return logits.masked_fill(logits < logits.amax(-1, keepdim=True), float("-inf"))


class DropTheTop(TopKTopPMinP):
    """Removes every row's most likely token (after the default filters), counting its calls."""

    calls = 0

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        DropTheTop.calls += 1
        out = super().__call__(logits, sampling).clone()
        out[torch.arange(len(out)), out.argmax(-1)] = float("-inf")
        return out


class RemovesEverything(SamplingFilter):
    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        return torch.full_like(logits, float("-inf"))


def test_a_filter_that_re_derives_the_default_gives_the_default_tokens(model_factory, default_tokens):
    llm = tiny(model_factory, sampling_filter=RowByRowFilter())
    assert run(llm, SAMPLED) == default_tokens["sampled"]
    assert run(llm, GREEDY) == default_tokens["greedy"]


def test_the_filter_is_the_one_the_sampler_draws_through(model_factory, default_tokens):
    assert default_tokens["sampled"] != default_tokens["greedy"]  # else this test could not fail
    llm = tiny(model_factory, sampling_filter=KeepTheTop())
    assert run(llm, SAMPLED) == default_tokens["greedy"]


def test_a_filter_never_changes_a_greedy_row(model_factory, default_tokens):
    """Greedy and sampled rows share every step; the filter runs over both, and the greedy row keeps its argmax."""
    DropTheTop.calls = 0
    llm = tiny(model_factory, sampling_filter=DropTheTop())
    mixed = [GREEDY, SAMPLED[1], GREEDY, SAMPLED[3]]
    tokens = run(llm, mixed)
    assert DropTheTop.calls > 0
    assert [tokens[0], tokens[2]] == [default_tokens["greedy"][0], default_tokens["greedy"][2]]


def test_a_filter_that_empties_a_row_fails_its_request_naming_the_rule(model_factory):
    llm = tiny(model_factory, sampling_filter=RemovesEverything())
    [out] = llm.generate(PROMPTS[0], SAMPLED[0], use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert FilterContractError.__name__ in out.error and "RULE: every sampled row keeps at least one token" in out.error


def test_a_filter_is_refused_where_it_cannot_be_used(model_factory):
    with pytest.raises(ValueError, match="sampling_filter=KeepTheTop.*speculative_config"):
        EngineConfig(model="m", sampling_filter=KeepTheTop(),
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="sampling_filter='top_k' is not a SamplingFilter"):
        EngineConfig(model="m", sampling_filter="top_k")
    # The Triton sampler filters inside its kernel (on CPU it runs in Triton's interpreter: conftest.py).
    with pytest.raises(ValueError, match="sampling_filter=KeepTheTop.*pass attention_backend='torch'"):
        tiny(model_factory, attention_backend="triton", block_size=16, sampling_filter=KeepTheTop())


# --- the config with objects in it -----------------------------------------------------------------------
def test_a_config_with_objects_replaces_hashes_and_pickles():
    backend, filt, alloc = TorchAttentionBackend(4, 2, 16), KeepTheTop(), LRUAllocator()
    config = EngineConfig(model="m", attention_backend=backend, sampling_filter=filt, block_allocator=alloc)
    copy = config.replace(seed=3)
    assert (copy.attention_backend, copy.sampling_filter, copy.block_allocator) == (backend, filt, alloc)
    assert config.replace() == config and hash(config.replace()) == hash(config)  # objects hash by identity
    back = pickle.loads(pickle.dumps(config))  # objects of module-level classes pickle
    assert type(back.attention_backend) is TorchAttentionBackend and type(back.block_allocator) is LRUAllocator
    assert dataclasses.replace(config, sampling_filter=None).sampling_filter is None


def test_a_flag_for_an_object_field_says_to_pass_it_from_python(capsys):
    from minivllm.entrypoints import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--sampling-filter", "top_k"])
    assert "sampling_filter takes a SamplingFilter object" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["serve", "--attention-backend", "torch", "--scheduling-policy", "priority"])
    assert (args.attention_backend, args.scheduling_policy) == ("torch", "priority")  # names stay flags


def test_a_sequence_has_everything_a_policy_may_read():
    """`SchedulableRequest` (minivllm/seams.py) lists what a policy may read of a request; the engine hands
    policies its `Sequence`s, so each of those attributes must exist there (the Protocol cannot drift)."""
    from minivllm.engine.request.sequence import Sequence
    from minivllm.sampling_params import SamplingParams
    from minivllm.seams import SchedulableRequest

    names = [n for n in vars(SchedulableRequest) if not n.startswith("_")]
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    assert names and all(hasattr(seq, n) for n in names), [n for n in names if not hasattr(seq, n)]
