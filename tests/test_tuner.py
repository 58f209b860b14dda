"""The one tuner (cpu/tuner.py) and its cache (cpu/tuning_cache.py): measured once per machine
setting, reused without timing, re-measured when any part of the key changes, a corrupt file ignored
and rewritten, concurrent processes agreeing, and the same greedy tokens in every process.

Each test has its own cache folder (conftest.py's `own_tuning_cache`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minivllm import LLM
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.cpu import tuner, tuning_cache
from minivllm.cpu.norm_rope_kernels import NormRopeKernels
from minivllm.cpu.tuning_cache import MachineKey, TuningCache

needs_kernels = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().detail)
ROOT = Path(__file__).resolve().parent.parent



def fast_b(name: str) -> None:  # a probe where candidate "b" is clearly faster than the default "a"
    sum(range(20000 if name == "a" else 10))


def test_a_choice_is_measured_once_then_read_from_the_cache(timings):
    first = tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached")
    assert (first.chosen, first.source) == ("b", "measured") and first.used and len(timings) == 1
    again = tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached")
    assert (again.chosen, again.source, again.speedups) == ("b", "cached", first.speedups) and len(timings) == 1
    stored = json.loads(TuningCache().path.read_text())
    assert stored["entries"]["toy"][""]["chosen"] == "b" and stored["machine"]["threads"] == torch.get_num_threads()


def test_off_times_nothing_and_remeasure_times_again(timings):
    assert tuner.choose("toy", ("a", "b"), lambda: [fast_b], "off") == tuner.untimed("a", "tuning off")
    assert not timings and not TuningCache().path.exists()
    tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached")
    assert tuner.choose("toy", ("a", "b"), lambda: [fast_b], "remeasure").source == "measured"
    assert len(timings) == 2
    with pytest.raises(ValueError, match="choose one of"):
        tuner.choose("toy", ("a", "b"), lambda: [fast_b], "sometimes")


def test_each_decision_is_decided_against_its_own_default_and_a_changed_default_is_measured_again(caplog):
    """The matmul plan's default depends on the dtype and the row count (bf16 widens from 5 rows where
    oneDNN takes no bf16): each decision of one entry keeps its own default, the first of its candidates,
    and an entry timed against another default (another contest) is never replayed."""
    measured = []

    def measure() -> dict[str, dict[str, float]]:  # "a" 1.5x faster than "b"; "c" as fast as either default
        measured.append(1)
        return {"few": {"b": 1 / 1.5, "c": 1.0}, "many": {"a": 1.5, "c": 1.0}}

    choices = tuner.choose_many("plan", measure, "cached", candidates={"few": ("a", "b", "c"), "many": ("b", "a", "c")})
    assert {name: (c.chosen, c.default) for name, c in choices.items()} == {"few": ("a", "a"), "many": ("a", "b")}
    swapped = {"few": ("b", "a", "c"), "many": ("b", "a", "c")}  # "few" now defaults to "b": another contest
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        again = tuner.choose_many("plan", lambda: {"few": {"a": 1.5, "c": 1.0}, "many": {"a": 1.5, "c": 1.0}},
                                  "cached", candidates=swapped)
    assert again["few"].source == "measured" and again["few"].default == "b" and "timed over" in caplog.text
    assert tuner.choose_many("plan", measure, "cached", candidates=swapped)["many"].source == "cached"
    assert len(measured) == 1


@pytest.mark.parametrize("part", [f.name for f in dataclasses.fields(MachineKey)])
def test_any_change_to_the_machine_key_measures_again(part, timings, monkeypatch):
    tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached")
    here = MachineKey.here()
    other = dataclasses.replace(here, **{part: 99 if part == "threads" else "other"})
    monkeypatch.setattr(MachineKey, "here", classmethod(lambda cls: other))
    tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached")
    assert len(timings) == 2 and len(list(tuning_cache.tuning_folder().glob("*.json"))) == 2


def test_a_cap_on_torchs_libraries_is_another_machine(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    uncapped = MachineKey.here()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN then runs other kernels, and packs no bf16
    assert MachineKey.here().digest() != uncapped.digest()


@needs_kernels
def test_another_dtype_or_shape_is_another_entry(timings):
    for dtype, hidden in ((torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 128), (torch.float32, 64)):
        NormRopeKernels().choose(hidden, 4, 2, 16, dtype)
    assert len(timings) == 3  # the last one repeats the first: read back


def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(timings, caplog):
    path = TuningCache().path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": 1, "entries": {"toy": ')  # cut short, as by a full disk
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        assert tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached").source == "measured"
    assert "cannot be read" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text())["entries"]["toy"][""]["chosen"] == "b"


RACE = textwrap.dedent("""
    import random, sys, time
    from minivllm.cpu import tuner
    def noisy(name):  # a tie made of noise: each process may well decide otherwise
        time.sleep(random.random() * 0.004)
    start = float(sys.argv[1])
    time.sleep(max(0.0, start - time.time()))  # both begin together
    print(tuner.choose("race", ("a", "b", "c"), lambda: [noisy], "cached", margin=0.0, repeats=20).chosen)
""")


def test_two_processes_measuring_at_once_end_with_one_choice(tmp_path):
    import time

    script = tmp_path / "race.py"
    script.write_text(RACE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = str(time.time() + 4)
    runs = [subprocess.Popen([sys.executable, str(script), start], stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    chosen = [r.communicate(timeout=120)[0].strip() for r in runs]
    assert all(r.returncode == 0 for r in runs)
    files = list(tuning_cache.tuning_folder().glob("*.json"))
    assert len(files) == 1 and chosen[0] == chosen[1] == json.loads(files[0].read_text())["entries"]["race"][""]["chosen"]


def test_an_engine_start_reuses_the_cache_and_tuning_off_times_nothing(qwen3_dir, timings):
    def start(**options) -> list[str]:
        llm = LLM(qwen3_dir, block_size=4, num_kv_blocks=64, **options)
        lines = llm.llm_engine.model_runner.measure_cpu_kernels("cached")
        llm.shutdown()
        return lines

    start()
    measured = len(timings)
    assert measured == (3 if load_cpu_kernels().available else 0)  # norm/RoPE, decode attention, greedy
    lines = start()
    assert len(timings) == measured  # the second start timed nothing
    if measured:
        assert any("cached" in line for line in lines)
    start(tuning="off")
    assert len(timings) == measured


GREEDY = textwrap.dedent("""
    import sys
    from minivllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], block_size=4, num_kv_blocks=64, dtype="bfloat16")
    out = llm.generate([{"prompt_token_ids": [5, 9, 2, 7]}], SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)
    print(out[0].outputs[0].token_ids)
""")


def test_two_fresh_processes_give_the_same_greedy_tokens(qwen3_dir, tmp_path):
    script = tmp_path / "greedy.py"
    script.write_text(GREEDY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outs = [subprocess.run([sys.executable, str(script), qwen3_dir], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.strip().startswith("[")


def test_minivllm_tune_measures_ahead_and_a_later_start_reads_it(qwen3_dir, tmp_path, capsys, monkeypatch):
    from minivllm.entrypoints.cli import main
    from minivllm.cpu.tuning_cache import TuningCache

    monkeypatch.setenv("MINIVLLM_TUNING_CACHE", str(tmp_path / "tune"))
    assert main(["tune", "--model", qwen3_dir]) == 0
    printed = capsys.readouterr().out
    assert "matmul:" in printed and f"saved in {TuningCache().path}" in printed
    saved = json.loads(TuningCache().path.read_text())
    assert saved, "nothing was saved"
    assert main(["tune", "--model", qwen3_dir, "--tuning", "off"]) == 1  # tune always re-measures: one clear error
    assert "always re-measures" in capsys.readouterr().err


def test_a_choice_says_what_it_chose_and_a_forced_one_must_be_a_candidate():
    choice = tuner.forced(("sdpa", "kernel"), "kernel", "forced by hand").about("decode attention", "2 rows x 8 keys")
    assert choice.used and choice.default == "sdpa"
    assert str(choice) == "decode attention: kernel (forced by hand)"
    timed = tuner.Choice("kernel", "sdpa", {"kernel": 1.5}, "measured").about("decode attention", "2 rows x 8 keys")
    assert str(timed) == "decode attention: kernel (vs sdpa: kernel 1.50x at worst of 2 rows x 8 keys, measured)"
    with pytest.raises(ValueError, match="'other' is not one of the candidates"):
        tuner.forced(("sdpa", "kernel"), "other", "forced by hand")
