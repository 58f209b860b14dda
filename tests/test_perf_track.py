"""The performance track (teaching/perf_track.py) and the speed assignment (teaching/perf_speed.py).

What is checked: the speed grader passes its reference and refuses each planted mistake naming its rule;
the track refuses a wrong solution before timing anything, and after timing refuses wrong timed results (a
cache the grader did not see) and figures above the roof; its table never runs columns together; it runs end
to end on correct solutions (tiny shapes, one trial: it only has to work) and writes the roofline PNG beside
the file; its trials alternate in order and its figures are medians. Nothing here asserts a timing: timings
belong to the command's output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.skinny_gemm import naive_skinny_gemm
from minivllm.teaching import perf_measure
from minivllm.teaching.hands_on import AssignmentError
from minivllm.teaching.perf_measure import CaseResult, PerfResult, TimedCaseResult, TrialResult, alternate
from minivllm.teaching.perf_roofline import intensity
from minivllm.teaching.perf_speed import ROUND_ONCE_ULP, check_speed_probes, load_speed_solution, make_operands
from minivllm.teaching.perf_track import QUICK_BANNER, main, refusal, table
from minivllm.teaching.perf_workloads import PerfSettings
from minivllm.teaching.submission_rules import RULES, source_violations

TESTS = Path(__file__).resolve().parent
SOLUTIONS, MISTAKES = TESTS / "hands_on_solutions", TESTS / "hands_on_mistakes"
SPEED = SOLUTIONS / "speed.py"
QUICK = ["--quick", "--trials", "1", "--rounds", "1", "--set-mib", "1"]

OWN_KERNEL_RULE = "RULE: the speed assignment is written by you"
# Each planted mistake (tests/hands_on_mistakes/) and the probe (its rule) that must refuse it.
SPEED_MISTAKES = [("speed_no_transpose.py", "probe 'one row'"), ("speed_row_tiles.py", "probe 'rows 1-8'"),
                  ("speed_ragged_out.py", "probe 'ragged out'"), ("speed_bf16_sum.py", "probe 'bf16 sums'"),
                  ("speed_bf16_blocks.py", "probe 'bf16 round once'"), ("speed_memo.py", "probe 'x refilled'"),
                  ("speed_reused_out.py", "probe 'results kept'"), ("speed_engine_kernel.py", OWN_KERNEL_RULE),
                  ("speed_runtime_names.py", "called minivllm.kernels.")]


def test_speed_reference_passes_the_probes():
    check_speed_probes(load_speed_solution(SPEED))


def test_speed_starter_is_not_written_yet():
    starter = TESTS.parent / "exercises" / "hands_on" / "5_speed" / "my_speed.py"
    with pytest.raises(NotImplementedError):
        check_speed_probes(load_speed_solution(starter))


@pytest.mark.parametrize("mistake, rule", SPEED_MISTAKES, ids=[m for m, _ in SPEED_MISTAKES])
def test_speed_probes_refuse_each_planted_mistake_by_its_rule(mistake, rule):
    with pytest.raises(AssignmentError, match=rule.replace("(", r"\(")):
        check_speed_probes(load_speed_solution(MISTAKES / mistake))


def test_engine_names_are_found_in_code_not_in_comments():
    rules = RULES["speed"]
    assert source_violations("import torch\ny = torch.ops.minivllm_cpu.skinny_gemm(x, w, 4, None)", rules)
    assert source_violations("import torch\nop = getattr(torch.ops, 'minivllm_cpu')", rules)
    assert source_violations("m = importlib.import_module('minivllm.kernels.skinny_gemm')", rules)
    assert source_violations("from minivllm.kernels import skinny_gemm as s", rules)
    assert source_violations("from tests.hands_on_solutions.speed import few_row_matmul", rules)
    assert source_violations("import testsuite\nimport torch", rules) == []
    prose = '"""Faster than skinny_gemm? Not yet."""\n# skinny_gemm packs 16 columns\nx = 1'
    assert source_violations(prose, rules) == []


def test_the_engine_op_reached_by_a_name_built_at_run_time_is_refused():
    """No import, name or string in the file names the op, and no Python frame of the engine runs: the
    dispatcher sees torch.ops.minivllm_cpu (loaded here, as the track loads it to time the engine)."""
    if not load_cpu_kernels().available:
        pytest.skip("the engine's CPU kernels are not built on this machine (no C++ compiler)")
    with pytest.raises(AssignmentError, match=OWN_KERNEL_RULE) as error:
        check_speed_probes(load_speed_solution(MISTAKES / "speed_compiled_op.py"))
    assert "it ran torch.ops.minivllm_cpu.skinny_gemm" in str(error.value)


def test_code_honest_only_while_watched_is_refused_after_its_timing(capsys):
    """The timed rounds run without the watch: a file that reaches the engine's kernel only when no trace hook is
    set passes the probes, and is refused because its timed process loaded the engine's compiled ops."""
    if not load_cpu_kernels().available:
        pytest.skip("the engine's CPU kernels are not built on this machine (no C++ compiler)")
    assert main(["speed", str(MISTAKES / "speed_untraced_engine.py"), *QUICK]) == 1
    out = capsys.readouterr().out
    assert "passed the speed assignment's probes" in out and OWN_KERNEL_RULE in out
    assert "was loaded in your timed process" in out and "yours/engine" not in out


@pytest.mark.parametrize("mistake, rule", SPEED_MISTAKES[:2] + SPEED_MISTAKES[-1:],
                         ids=[m for m, _ in SPEED_MISTAKES[:2] + SPEED_MISTAKES[-1:]])
def test_track_refuses_a_wrong_solution_before_timing(mistake, rule, capsys, monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("a wrong solution was timed")

    monkeypatch.setattr("minivllm.teaching.perf_track.alternate", no_timing)
    assert main(["speed", str(MISTAKES / mistake), *QUICK]) == 1
    out = capsys.readouterr().out
    assert rule in out and "speed is credited only to correct code" in out


def test_track_refuses_a_wrong_hands_on_part_through_its_grader(tmp_path, capsys, monkeypatch):
    source = (SOLUTIONS / "allocator.py").read_text()
    anchor = "min(self.stamps, key=self.stamps.__getitem__)"
    assert source.count(anchor) == 1
    wrong = tmp_path / "mru.py"
    wrong.write_text(source.replace(anchor, "max(self.stamps, key=self.stamps.__getitem__)"))  # MRU, not LRU
    monkeypatch.setattr("minivllm.teaching.perf_track.alternate", lambda *a, **k: pytest.fail("timed a wrong one"))
    assert main(["allocator", str(wrong), "--no-engine", *QUICK]) == 1
    out = capsys.readouterr().out
    assert "✗" in out and "no speed measured" in out


def test_trials_alternate_in_fresh_processes_and_report_medians(monkeypatch):
    order, times = [], {"student": iter([3.0, 1.0, 2.0]), "engine": iter([1.0, 9.0, 1.5])}

    def fake_trial(part, side, path, settings):
        order.append(side)
        case = TimedCaseResult("float32 1 row x 4x4", next(times[side]), 2000)
        return TrialResult.from_json(TrialResult(side, side, [case], 10.0 if side == "student" else 30.0).to_json())

    monkeypatch.setattr(perf_measure, "run_trial", fake_trial)
    result = alternate("speed", "any.py", PerfSettings(quick=True), trials=3)
    assert order == ["student", "engine", "engine", "student", "student", "engine"]
    case = result.cases[0]
    assert (case.student_s, case.engine_s, case.ratio) == (2.0, 1.5, 2.0 / 1.5)
    assert result.read_gb_s == 20.0  # the median of all six trials
    assert result.of_limit(case.student_s, case) == pytest.approx(2000 / 2.0 / 1e9 / 20.0)


def test_a_part_without_a_limit_reports_none():
    case = CaseResult("200 calls, 32 blocks", 2e-7, 1e-7, None)
    assert PerfResult("allocator", "Mine", "LRUAllocator", 1, [case], 30.0).of_limit(case.student_s, case) is None
    assert intensity("bfloat16 8 rows x 64x64") == 8.0 and intensity("float32 1 row x 64x64") == 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the kernel is timed")
def test_kernel_without_cuda_says_so_and_times_nothing(capsys):
    assert main(["kernel", str(SOLUTIONS / "kernel.py")]) == 0
    assert "CUDA GPU" in capsys.readouterr().out


def test_plot_folder_is_checked_before_timing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["speed", str(SPEED), "--plot", str(tmp_path / "missing" / "roofline.png")])
    assert "does not exist" in capsys.readouterr().err


def test_track_runs_on_the_speed_reference_and_writes_the_roofline(tmp_path, capsys):
    png = tmp_path / "roofline.png"
    assert main(["speed", str(SPEED), *QUICK, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "yours/engine" in out and "of limit" in out and "bfloat16 8 rows" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow  # two fresh processes each, plus the part's quick grader
@pytest.mark.parametrize("part, reference", [("attention", "attention.py"), ("filter", "sampling_filter.py"),
                                             ("allocator", "allocator.py")])
def test_track_runs_on_each_hands_on_reference(part, reference, capsys):
    assert main([part, str(SOLUTIONS / reference), "--no-engine", *QUICK]) == 0
    out = capsys.readouterr().out
    assert "yours/engine" in out and "alternating" in out


def test_round_once_probe_sums_exactly_in_fp32_and_a_bf16_running_sum_breaks_it():
    x, weight = make_operands(2, 48, 2048, torch.bfloat16, exact_sums=True)  # (2, 2048), (48, 2048)
    exact = x.double() @ weight.double().t()  # (2, 48): the true sums, exact in fp32 by construction
    assert torch.equal((x.float() @ weight.float().t()).double(), exact)
    want = naive_skinny_gemm(x, weight)
    assert bool(((want.double() - exact).abs() <= ROUND_ONCE_ULP * exact.abs()).all())  # rounded once: <= 1 ulp
    running = torch.zeros(2, 48, dtype=torch.bfloat16)
    for k0 in range(0, 2048, 64):
        running += x[:, k0:k0 + 64] @ weight[:, k0:k0 + 64].t()  # a bf16 running sum over fp32 blocks
    assert float((running.double() - exact).abs().max()) > 100 * ROUND_ONCE_ULP * float(exact.abs().max())


def test_x_is_contiguous_as_the_starter_says_and_the_probes_keep_that_promise(tmp_path):
    starter = (TESTS.parent / "exercises" / "hands_on" / "5_speed" / "my_speed.py").read_text()
    assert "x is contiguous" in starter
    strict = tmp_path / "strict.py"
    strict.write_text((SOLUTIONS / "speed.py").read_text().replace(
        "    return torch.mm(x, packed)", "    assert x.is_contiguous()\n    return torch.mm(x, packed)"))
    check_speed_probes(load_speed_solution(strict))


@pytest.mark.parametrize("cache", ["speed_memo.py", "speed_reused_out.py"])
def test_track_refuses_timed_results_a_cache_made_wrong(cache, capsys, monkeypatch):
    monkeypatch.setattr("minivllm.teaching.perf_track.grade_first", lambda *a, **k: 0)  # as if the probes missed it
    assert main(["speed", str(MISTAKES / cache), *QUICK]) == 1
    out = capsys.readouterr().out
    assert "no speed credited: a timed call returned a wrong result" in out and "yours/engine" not in out


def fake_result(student_s: float, engine_s: float = 1e-4) -> PerfResult:
    cases = [CaseResult("float32 1 row x 64x64", student_s, engine_s, 64 * 64 * 4),
             CaseResult("bfloat16 8 rows x 64x64", 2e-6, 1e-6, 64 * 64 * 2)]
    return PerfResult("speed", "mine.py", "skinny_gemm", 1, cases, 30.0)


def test_a_figure_above_the_roof_is_flagged_and_earns_nothing(capsys, monkeypatch):
    monkeypatch.setattr("minivllm.teaching.perf_track.alternate", lambda *a, **k: fake_result(1e-8))  # 1638 GB/s
    assert main(["speed", str(SPEED), *QUICK]) == 1
    out = capsys.readouterr().out
    assert "WARNING: above 100 % of the limit" in out and "5461%!" in out
    assert "no speed credited" in out and "cached" in out


def test_a_figure_a_little_above_the_roof_is_noise_not_a_refusal():
    near = fake_result(64 * 64 * 4 / (1.05 * 30e9))  # 105 % of the 30 GB/s roof: what the engine itself can print
    assert near.of_limit(near.cases[0].student_s, near.cases[0]) == pytest.approx(1.05)
    assert refusal(near) is None
    assert refusal(fake_result(64 * 64 * 4 / (1.3 * 30e9))) is not None  # 130 %: no code that reads W is that fast


def test_table_columns_never_run_together_and_quick_says_it_is_no_measurement(tmp_path, capsys, monkeypatch):
    rows = table(fake_result(1e-7, 1.216e-4)).splitlines()  # 1216x the engine's speed
    assert all(len(re.split(r"\s{2,}", line.strip())) == 8 for line in rows)
    assert "1216x" in rows[1]
    trials = []
    monkeypatch.setattr("minivllm.teaching.perf_track.alternate",
                        lambda part, path, settings, n: trials.append(n) or fake_result(2e-6))
    assert main(["speed", str(SPEED), "--quick"]) == 0
    out = capsys.readouterr().out
    assert trials == [1] and out.count(QUICK_BANNER) >= 2 and "roofline saved" not in out


def test_roofline_is_saved_beside_the_students_file_by_default(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "my_speed.py"
    mine.write_text((SOLUTIONS / "speed.py").read_text())
    monkeypatch.setattr("minivllm.teaching.perf_track.alternate", lambda *a, **k: fake_result(2e-6))
    assert main(["speed", str(mine), "--trials", "1"]) == 0
    assert (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"roofline saved to {tmp_path / 'roofline.png'}" in capsys.readouterr().out
