"""Small rules where a client written for vLLM looks for vLLM's exact behaviour, each checked here the way
vLLM behaves (vLLM's tests check them on its models; these are ours, on the tiny one):

- `truncation_side`: "right" keeps the prompt's first `truncate_prompt_tokens`, "left" (the default) the last;
- `usage.prompt_tokens_details`: `{"cached_tokens": n}` when the prefix cache served n > 0 prompt tokens, else
  null (vLLM's serving_completion.py / serving_chat.py);
- `seed` bounds are a torch.long's, refused in pydantic's words with its error type, which vLLM's answer carries;
- a prompt's token id outside the vocabulary: "Token id N is out of vocabulary" (vLLM's input processor);
- prompt logprobs: k entries at a position whose prompt token is among the k most likely, k + 1 otherwise
  (the token itself added: vLLM's LogprobsProcessor), next to chat's `top_logprobs`, exactly N per token.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import events, serving

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.server import build_app

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Where was the world series played in 2020?"}]
PROMPT = list(range(40, 70))  # 30 token ids


@pytest.fixture(scope="module")
def url(qwen3_dir):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=qwen3_dir, num_kv_blocks=128, max_model_len=256)))
    with serving(build_app(engine, MODEL)) as url:
        yield url
    engine.shutdown()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def complete(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"max_tokens": 1, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# --- truncation_side ------------------------------------------------------------------------------------

@pytest.mark.parametrize("side,kept", [("right", PROMPT[:5]), ("left", PROMPT[-5:]), (None, PROMPT[-5:])])
def test_truncation_side_picks_the_end_kept(url, side, kept):
    side_field = {} if side is None else {"truncation_side": side}
    got = complete(url, prompt=PROMPT, truncate_prompt_tokens=5, return_token_ids=True, **side_field)
    assert got["choices"][0]["prompt_token_ids"] == kept and got["usage"]["prompt_tokens"] == 5
    alone = complete(url, prompt=kept, return_token_ids=True)  # the same request as the kept tokens alone
    assert got["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_truncation_side_applies_to_text_prompts_and_echo(url):
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "one two three four five six seven eight"}).json()["tokens"]
    got = complete(url, prompt="one two three four five six seven eight", truncate_prompt_tokens=4,
                   truncation_side="right", echo=True, max_tokens=0, return_token_ids=True)
    assert got["choices"][0]["prompt_token_ids"] == ids[:4]
    decoded = httpx.post(f"{url}/detokenize", json={"tokens": ids[:4]}).json()["prompt"]
    assert got["choices"][0]["text"] == decoded  # echo shows what was kept


def test_truncation_side_is_checked(url):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "truncation_side": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side", r.text


# --- usage.prompt_tokens_details ------------------------------------------------------------------------

def test_prompt_tokens_details_are_null_without_a_cache_hit(url, client):
    prompt = [t % 300 + 5 for t in range(1000, 1040)]  # a prompt no other test sends
    first = complete(url, prompt=prompt)
    assert "prompt_tokens_details" in first["usage"] and first["usage"]["prompt_tokens_details"] is None
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # 2 full blocks of 16 (the last token is computed)
    chat = [{"role": "user", "content": "details " * 3 + "of a fresh chat"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": chat, "max_tokens": 1, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert events(r)[-2]["usage"]["prompt_tokens_details"] is None


# --- seed -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed,kind", [(2**63, "less_than_equal"), (-2**63 - 1, "greater_than_equal")])
def test_seeds_out_of_a_long_are_refused_in_vllms_words(url, seed, kind):
    for path, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": MESSAGES})):
        r = httpx.post(f"{url}/v1/{path}", json={**body, "max_tokens": 1, "seed": seed})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "seed", r.text
        assert kind in error["message"] and "Input should be" in error["message"]


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63])
def test_the_bounds_themselves_are_seeds(url, seed):
    complete(url, prompt="Hi", seed=seed, temperature=1.0)


# --- out of vocabulary ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [[5, 384], [-3, 5], [[5, 6], [7, 10**6]]])
def test_a_prompt_id_out_of_the_vocabulary_says_so(url, client, prompt):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt", r.text
    assert error["message"].startswith("Token id ") and "is out of vocabulary" in error["message"]
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)


# --- prompt logprobs: k, or k + 1 with the prompt token -------------------------------------------------

def entries_follow_vllms_rule(prompt_logprobs: list, prompt_token_ids: list[int], k: int) -> list[int]:
    """Each position's entries: the k most likely (ranks 1..k), plus the prompt token when it is not one of
    them; returns how many entries each position has."""
    assert prompt_logprobs[0] is None  # nothing comes before the first token
    sizes = []
    for token, position in zip(prompt_token_ids[1:], prompt_logprobs[1:]):
        ranks = sorted(entry["rank"] for entry in position.values())
        own = position[str(token)]["rank"]
        assert ranks[:k] == list(range(1, k + 1)) and len(position) == k + (own > k)
        sizes.append(len(position))
    return sizes


@pytest.mark.parametrize("k", [1, 2])
def test_a_predicted_prompt_token_is_not_counted_twice(url, k):
    greedy = complete(url, prompt=PROMPT[:8], max_tokens=12, ignore_eos=True, return_token_ids=True)
    scored = PROMPT[:8] + greedy["choices"][0]["token_ids"]  # its last 12 tokens are the model's own top choices
    got = complete(url, prompt=scored, prompt_logprobs=k, return_token_ids=True)
    sizes = entries_follow_vllms_rule(got["choices"][0]["prompt_logprobs"], scored, k)
    assert sizes[-12:].count(k) >= 10  # predicted tokens: k entries (not k + 1), near-ties aside
    assert k + 1 in sizes  # somewhere in a random model's prompt, a token outside its k most likely


def test_chat_top_logprobs_with_prompt_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=1, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    assert all(len(token.top_logprobs) == 1 for token in r.choices[0].logprobs.content)
    assert [t.token for t in r.choices[0].logprobs.content] == [t.top_logprobs[0].token
                                                                for t in r.choices[0].logprobs.content]  # greedy
    entries_follow_vllms_rule(r.prompt_logprobs, r.prompt_token_ids, 1)
