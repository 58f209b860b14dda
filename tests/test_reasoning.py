"""The reasoning parser (minivllm/reasoning.py): splitting <think>…</think> from the answer on fixed strings,
whole and streamed in awkward pieces; the engine's grammar applying after </think> only (masks, drafts that
cross the boundary, n > 1, a prompt that closed the reasoning, max_tokens inside it); the config's checks."""

from __future__ import annotations

import re

import pytest
import torch
from reasoning_helpers import make_thinking_qwen3

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.config import EngineConfig
from minivllm.engine.spec_decode.proposer import Draft, Proposer
from minivllm.reasoning import (ReasoningConfig, ReasoningParserName, ReasoningPhase, ReasoningSplit,
                                ReasoningStream, split_reasoning)
from minivllm.teaching.checkpoints import make_tokenizer

MAY_OPEN, INSIDE, ENDED = ReasoningPhase.MAY_OPEN, ReasoningPhase.INSIDE, ReasoningPhase.ENDED
DIGITS = StructuredOutputsParams(regex="[0-9]{1,4}")  # no letters: a reasoning with letters is unconstrained

# --- fixed strings -----------------------------------------------------------------------------------------

CASES = [  # (text, phase at the first output token, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\n42", MAY_OPEN, "\nLet me see.\n", "\n\n42"),
    ("42, no thinking", MAY_OPEN, None, "42, no thinking"),
    ("<think>cut by max_tokens", MAY_OPEN, "cut by max_tokens", None),
    ("<thinking is a word", MAY_OPEN, None, "<thinking is a word"),
    ("<thi", MAY_OPEN, None, "<thi"),  # a lone piece of <think> is text
    ("opened by the prompt</think>answer", INSIDE, "opened by the prompt", "answer"),
    ("<think>R1 wrote it anyway</think>answer", INSIDE, "R1 wrote it anyway", "answer"),
    ("never closed </th", INSIDE, "never closed </th", None),
    ("a</think>b</think>c", INSIDE, "a", "b</think>c"),  # only the first </think> ends it
    ("<think>x</think>y", ENDED, None, "<think>x</think>y"),  # the prompt closed it: all answer
    ("", MAY_OPEN, None, ""),
]


@pytest.mark.parametrize("text,phase,reasoning,content", CASES)
def test_split_on_fixed_strings(text, phase, reasoning, content):
    assert split_reasoning(text, phase) == ReasoningSplit(reasoning, content)


@pytest.mark.parametrize("text,phase", [(c[0], c[1]) for c in CASES])
def test_any_split_of_a_stream_sends_what_the_whole_gives(text, phase):
    whole = split_reasoning(text, phase)
    for cuts in [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(len(text)) for j in range(i, len(text))]:
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
        stream, sent = ReasoningStream(phase), []
        for p in pieces:
            sent.append(stream.feed(p))
            assert "</think>" not in sent[-1][0]  # the tag itself is never sent as reasoning
        sent.append(stream.finish())
        reasoning, content = "".join(s[0] for s in sent), "".join(s[1] for s in sent)
        assert reasoning == (whole.reasoning or "") and content == (whole.content or ""), pieces


def test_awkward_cut_inside_the_closing_tag_is_held_back():
    stream = ReasoningStream(INSIDE)
    assert stream.feed("plan: add</thi") == ("plan: add", "")  # "</thi" may be the tag: held back
    assert stream.feed("nk>{\"a\"") == ("", "{\"a\"")
    assert stream.feed(":1}") == ("", ":1}") and stream.finish() == ("", "")
    stream = ReasoningStream(MAY_OPEN)
    assert stream.feed("<th") == ("", "") and stream.feed("ink>r") == ("r", "") and stream.finish() == ("", "")


def test_parser_names_and_tokenizers_are_checked():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        EngineConfig(model="m", reasoning_parser="qwen")
    assert ReasoningParserName.parse("deepseek_r1") is ReasoningParserName.DEEPSEEK_R1
    plain = make_tokenizer(64)
    with pytest.raises(ValueError, match="lacks <think>, </think>"):
        ReasoningConfig.from_tokenizer("qwen3", plain)
    plain.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    with pytest.raises(ValueError, match="as special"):
        ReasoningConfig.from_tokenizer("qwen3", plain)


def test_the_prompt_decides_where_the_output_starts():
    qwen, r1 = (ReasoningConfig(n, 90, 91) for n in ReasoningParserName)
    assert qwen.prompt_phase([5, 90, 7, 91, 8]) is ENDED  # enable_thinking=False: "<think>\n\n</think>\n\n"
    assert qwen.prompt_phase([5, 91, 7, 90, 8]) is INSIDE  # the template opened it
    assert qwen.prompt_phase([5, 6]) is MAY_OPEN and r1.prompt_phase([5, 6]) is INSIDE


# --- the engine --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return make_thinking_qwen3(tmp_path_factory.mktemp("thinking_qwen3"))


@pytest.fixture(scope="module")
def llm(thinking):
    return LLM(thinking[0], warmup=False, reasoning_parser="qwen3", max_model_len=256, num_kv_blocks=64)


def test_a_tokenizer_without_think_tokens_refuses_the_parser(qwen3_dir):
    with pytest.raises(ValueError, match="lacks <think>"):
        LLM(qwen3_dir, warmup=False, reasoning_parser="qwen3")


def answer_after_reasoning(ids: list[int], end: int) -> list[int]:
    assert end in ids, ids
    return ids[ids.index(end) + 1:]


def test_the_grammar_holds_after_think_only(llm, thinking):
    _, start, end = thinking
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tok("<|im_start|>assistant\n").input_ids + [start]}  # reasoning is open
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, logit_bias={end: 4.0}, structured_outputs=DIGITS)
              for s in range(8)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    letters = 0
    for out in outs:
        c = out.outputs[0]
        answer = tok.decode(answer_after_reasoning(c.token_ids, end))
        assert re.fullmatch("[0-9]{1,4}", answer) and c.finish_reason == "stop", c
        letters += bool(re.search("[a-zA-Z]", tok.decode(c.token_ids[:c.token_ids.index(end)])))
    assert letters  # the reasoning drew what the grammar forbids


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token(llm, thinking):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "a number"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=1, logit_bias={thinking[2]: 5.0}, structured_outputs=DIGITS)
    (out,) = llm.generate([text], sp, use_tqdm=False)
    assert re.fullmatch("[0-9]{1,4}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


def test_n_children_and_max_tokens_inside_reasoning(llm, thinking):
    _, start, end = thinking
    prompt = {"prompt_token_ids": [5, 6, 7, start]}
    sp = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=3, logit_bias={end: 4.0}, structured_outputs=DIGITS)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    tok = llm.get_tokenizer()
    for c in out.outputs:  # each child copied its parent's phase, then went its own way
        assert re.fullmatch("[0-9]{1,4}", tok.decode(answer_after_reasoning(c.token_ids, end)))
    cut = SamplingParams(max_tokens=3, temperature=0, logit_bias={end: -100.0}, structured_outputs=DIGITS)
    (out,) = llm.generate([prompt], cut, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and end not in c.token_ids
    assert split_reasoning(c.text, INSIDE) == ReasoningSplit(c.text, None)


class OracleProposer(Proposer):
    """Drafts the reference output's next tokens: greedy verification must accept them all, across </think>."""

    def __init__(self, prompt_len: int, reference: list[int]) -> None:
        self.prompt_len, self.reference = prompt_len, reference

    def propose(self, requests):
        return [Draft(self.reference[len(r.token_ids) - self.prompt_len:][:r.max_tokens]) for r in requests]


def test_drafts_that_cross_the_end_of_reasoning_switch_masks_at_the_boundary(llm, thinking):
    path, start, end = thinking
    prompt = [30, 31, start]
    for bias in (1.9, 2.0, 1.7, 2.2, 1.5):  # a push on </think> that makes greedy reason a little, then end
        sp = SamplingParams(max_tokens=24, temperature=0, logit_bias={end: bias}, structured_outputs=DIGITS)
        (ref,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        ref = ref.outputs[0].token_ids
        if 0 < (ref.index(end) if end in ref else 0) < len(ref) - 1:
            break
    assert 0 < ref.index(end) < len(ref) - 1, ref  # reasoning, the boundary, an answer: the drafts cross it
    spec = LLM(path, warmup=False, reasoning_parser="qwen3", max_model_len=256, num_kv_blocks=64,
               speculative_config={"proposer": OracleProposer(len(prompt), ref), "num_speculative_tokens": 4})
    (out,) = spec.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    assert out.outputs[0].token_ids == ref
    assert spec.get_stats().num_accepted_tokens >= len(ref) - 1 - len(ref) // 5  # a step verifies 4, adds 5


def test_row_masks_switch_where_a_draft_ends_the_reasoning(llm, thinking):
    _, start, end = thinking
    tok, grammars = llm.get_tokenizer(), llm.llm_engine.input_processor.grammars
    reasoning = llm.llm_engine.resolved.reasoning
    one, two = tok.convert_tokens_to_ids(["1", "2"])
    inside = grammars.matcher(DIGITS, reasoning, INSIDE)
    rows = inside.row_masks([40, end, one, two])
    fresh = grammars.matcher(DIGITS).bitmasks([one, two])  # the grammar's own rows after the boundary
    assert rows[0] is None and rows[1] is None and all(torch.equal(r, f) for r, f in zip(rows[2:], fresh))
    assert inside.phase is INSIDE  # asking for masks moves nothing
    opening = grammars.matcher(DIGITS, reasoning, MAY_OPEN)
    first = opening.row_masks([start, 40])
    bit = lambda mask, t: bool((int(mask[t // 32]) >> (t % 32)) & 1)  # noqa: E731
    assert bit(first[0], start) and bit(first[0], one) and not bit(first[0], 40) and first[1:] == [None, None]
    answering = opening.row_masks([one])
    assert bit(answering[0], start) and not bit(answering[1], start)  # after a digit: the answer has begun
    assert opening.accept(start) and opening.phase is INSIDE and not opening.is_complete
    assert opening.accept(40) and opening.accept(end) and opening.phase is ENDED
    child = opening.copy()
    assert child.phase is ENDED and child.accept(one) and not opening.is_complete
