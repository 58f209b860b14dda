"""benchmarks/cuda_check.py's machinery on CPU: a hung part is killed at its timeout, a part's figures or its
failure reach the summary, the budget cuts timeouts, and a dry run writes the JSON summary (the GPU parts
themselves need a GPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cuda_check():
    """benchmarks/cuda_check.py, imported by path (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("cuda_check", ROOT / "benchmarks" / "cuda_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_check"] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_a_hung_part_is_killed_at_its_timeout(tmp_path):
    cc = _cuda_check()
    hang = [sys.executable, "-c", "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]
    result = cc.run_part("hang", hang, 2, tmp_path / "hang.json")
    assert result.timed_out and not result.ok and result.error == "timed out after 2 s"


def test_a_part_reports_its_figures_or_its_failure(tmp_path):
    cc = _cuda_check()
    out = tmp_path / "fig.json"
    writes = [sys.executable, "-c", f"import json; open({str(out)!r}, 'w').write(json.dumps({{'gbps': 4.5}}))"]
    ok = cc.run_part("writes", writes, 60, out)
    assert ok.ok and ok.figures == {"gbps": 4.5} and not ok.timed_out
    failed = cc.run_part("fails", [sys.executable, "-c", "raise SystemExit(3)"], 60, tmp_path / "none.json")
    assert not failed.ok and failed.error.startswith("exit status 3") and failed.figures == {}


def test_the_budget_cuts_each_timeout_and_skips_what_cannot_start():
    cc = _cuda_check()
    assert cc.part_timeout(90, 400) == 90
    assert cc.part_timeout(90, 30) == 30
    assert cc.part_timeout(90, 5) is None
    assert sum(cc.PART_TIMEOUTS.values()) <= 360  # the whole script within ~6 minutes


def test_a_bad_timeout_is_refused_with_what_to_write(capsys):
    cc = _cuda_check()
    with pytest.raises(SystemExit):
        cc.main(["--dry-run", "--timeout", "kernel_test=150"])
    assert "write PART=SECONDS" in capsys.readouterr().err


@pytest.mark.slow  # five processes that each import torch and minivllm (~20 s on 2 cores)
def test_a_dry_run_writes_the_summary_of_every_part(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cuda_check.py"), "--dry-run", "--out", str(tmp_path),
           "--timeout", "kernel_tests=150"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads((tmp_path / "cuda_check.json").read_text())
    cc = _cuda_check()
    assert [p["name"] for p in summary["parts"]] == list(cc.PARTS)
    assert summary["dry_run"] and all(p["ok"] and p["figures"]["dry_run"] for p in summary["parts"])
