"""Speculative decoding for a hybrid model (Qwen3.5): a verification keeps the linear-attention state
after every draft row (the state pool's candidate slots), and the commit publishes the one after the
last accepted draft. Greedy output equals the run without drafts; sampled tokens come from the
target's own distribution at every position, rejections included."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.spec_decode.proposer import Draft, DraftRequest, Proposer
from minivllm.teaching.checkpoints import make_tiny_model
from minivllm.teaching.hf_check import assert_hf_greedy

torch.set_num_threads(1)  # tiny tensors: threads only add overhead on 2 cores
REPEATING = [5, 6, 7, 8, 9, 10] * 4  # n-gram lookup finds continuations here
PROMPTS = [REPEATING, list(range(20, 61)), [3, 4, 3, 4, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


class Wrong(Proposer):
    """Drafts the greedy continuation a reference run produced, every third token wrong: acceptances
    and rejections at every draft position."""

    def __init__(self, futures: dict[tuple[int, ...], list[int]]) -> None:
        self.futures, self.calls = futures, 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            tokens = r.token_ids.tolist()
            future = next((f[len(tokens):] for p, f in self.futures.items() if tokens[:len(p)] == list(p)), [])
            self.calls += 1
            drafts.append(Draft([t if (i + self.calls) % 3 else (t + 1) % 384
                                 for i, t in enumerate(future[:r.max_tokens])]))
        return drafts


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3_5_spec"), family="qwen3_5", num_layers=4))


@pytest.fixture(scope="module")
def hf(hybrid_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()


def hybrid(path: str, spec: dict | None = None, **kwargs) -> LLM:
    return LLM(path, warmup=False, dtype="float32", speculative_config=spec,
               **{"block_size": 4, "num_kv_blocks": 96, "max_num_batched_tokens": 16, **kwargs})


def run(llm: LLM, sp: SamplingParams, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    return {tuple(p): p + o.outputs[0].token_ids for p, o in zip(PROMPTS, run(hybrid(hybrid_dir), GREEDY))}


@pytest.mark.parametrize("method", ["ngram", "draft", "wrong"])
def test_greedy_output_equals_the_run_without_drafts(hybrid_dir, hf, model_factory, reference, method):
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
            "draft": {"model": model_factory("qwen3"), "num_speculative_tokens": 3},
            "wrong": {"proposer": Wrong(reference), "num_speculative_tokens": 4}}[method]
    llm = hybrid(hybrid_dir, spec)  # chunked prefill beside verification
    outs = run(llm, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert p + o.outputs[0].token_ids == reference[tuple(p)]
        assert_hf_greedy(hf, p, o.outputs[0].token_ids)
    stats = llm.get_stats()
    assert stats.num_draft_tokens > 0 and stats.num_free_blocks == stats.num_total_blocks
    if method == "wrong":  # rejections at the first draft and later ones: every candidate slot was used
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and stats.num_steps < 3 * 16
    pool = llm.llm_engine.state_pool
    assert pool.num_free == pool.num_pairs


def test_sampled_tokens_come_from_the_targets_distribution(hybrid_dir, hf, reference):
    """Each emitted token's logprob (the target's raw distribution where it was drawn) is HF's at that
    position, teacher-forced: after every rejection the state was rolled back to the accepted draft."""
    llm = hybrid(hybrid_dir, {"proposer": Wrong(reference), "num_speculative_tokens": 3})
    sp = SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = run(llm, sp)
    assert llm.get_stats().num_accepted_tokens > 0
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        with torch.no_grad():
            lp = hf(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float().log_softmax(-1)  # (T, V)
        want = lp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        got = torch.tensor([c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)])
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    again = run(hybrid(hybrid_dir, {"proposer": Wrong(reference), "num_speculative_tokens": 3}), sp)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]  # seeded


def test_a_hybrid_draft_model_is_refused(hybrid_dir):
    with pytest.raises(ValueError, match="linear-attention layers, which minivllm does not run as a draft"):
        hybrid(hybrid_dir, {"model": hybrid_dir, "num_speculative_tokens": 2})
