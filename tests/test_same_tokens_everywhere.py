"""One machine, one request, one set of options: the same tokens through every entry point, in every process.

`minivllm generate`, `LLM.generate` and the server each run in a fresh process here, sharing one tuning
cache (as every process of one user does): the first start measures the CPU kernels' choices and saves
them, the others read them back, so all of them run the same arithmetic. Before the cache, each start
re-measured, and timing noise could pick another matmul form: the same greedy request gave different text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from minivllm.teaching.tiny_moe import make_tiny_moe_model
from server_helpers import free_port

PROMPT = "The capital of France is"
MAX_TOKENS = 24
HANG = 900  # only a hang reaches it: a busy machine may compile the C++ kernels first

API = """
import json, sys
from minivllm import LLM, SamplingParams
out = LLM(sys.argv[1]).generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=int(sys.argv[3])))
print(json.dumps(out[0].outputs[0].text))
"""


def through_the_api(model: str, env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-c", API, model, PROMPT, str(MAX_TOKENS)], capture_output=True, text=True,
                       env=env, timeout=HANG)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def through_the_cli(model: str, env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "generate", PROMPT, "--model", model,
                        "--max-tokens", str(MAX_TOKENS)], capture_output=True, text=True, env=env, timeout=HANG)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPT) and r.stdout.endswith("\n"), r.stdout
    return r.stdout[len(PROMPT):-1]  # the prompt, the completion, one newline


def through_the_server(model: str, env: dict[str, str], log_path: str) -> str:
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--model", model,
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + HANG
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, open(log_path).read()
        r = httpx.post(f"{url}/v1/completions", timeout=HANG,
                       json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})  # the one model served
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=300)


# A mixture of experts too: its CPU experts' method is attached at warm-up in every process (slow: 4 processes).
@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_a_greedy_request_gives_the_same_text_through_the_cli_the_api_and_the_server(family, qwen3_dir, tmp_path):
    model = qwen3_dir if family == "qwen3" else str(make_tiny_moe_model(tmp_path / "moe", family))
    env = {**os.environ, "MINIVLLM_TUNING_CACHE": str(tmp_path / "tuning")}
    first = through_the_api(model, env)  # measures, and saves the choices
    assert (tmp_path / "tuning").is_dir() and any((tmp_path / "tuning").iterdir()), "no tuning cache was written"
    texts = {"api (first process)": first, "api (second process)": through_the_api(model, env),
             "cli": through_the_cli(model, env),
             "server": through_the_server(model, env, str(tmp_path / "server.log"))}
    assert first and set(texts.values()) == {first}, texts
