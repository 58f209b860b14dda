"""The notebooks and the docs site: notebooks committed clean, the site built --strict (which executes
every notebook, failing on any error), and two pages checked in headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_ten_notebooks_committed_without_outputs_and_in_shape():
    assert len(NOTEBOOKS) >= 10
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), f"{path.name} has outputs"
        text = "\n".join("".join(c["source"]) for c in nb["cells"])
        for section in ("What you will learn", "## Experiment", "## Exercises"):
            assert section in text, f"{path.name} lacks '{section}'"
        assert "from minivllm" in text, f"{path.name} must call the package"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site: $MINIVLLM_SITE_DIR if CI built it already, else built here (executes notebooks)."""
    prebuilt = os.environ.get("MINIVLLM_SITE_DIR")
    if prebuilt and (Path(prebuilt) / "index.html").is_file():
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_site_has_every_section(site):
    for page in ("index.html", "getting-started/index.html", "architecture/index.html",
                 "concepts/paged-kv/index.html", "guides/server/index.html", "reference/engine/index.html",
                 "teachers/index.html", "notebooks/01_request_life/index.html", "notebooks/10_serving/index.html"):
        assert (site / page).is_file(), page
    engine_ref = (site / "reference/engine/index.html").read_text()
    assert "check_invariants" in engine_ref  # mkdocstrings rendered the docstrings
    for nb in NOTEBOOKS:
        html = (site / "notebooks" / nb.stem / "index.html").read_text()
        assert "data:image/png;base64" in html, f"{nb.stem} rendered no figure"


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pages_render_in_headless_chromium(site, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("MINIVLLM_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is required here (MINIVLLM_REQUIRE_BROWSER=1) but is not installed")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=site,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    artifacts = Path(os.environ.get("MINIVLLM_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1800"]
    try:
        time.sleep(0.5)
        base = f"http://127.0.0.1:{port}"

        def dom(url: str) -> str:
            r = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
            return r.stdout

        home = dom(f"{base}/index.html")
        assert "<h1" in home and "minivllm" in home and "architecture.svg" in home
        page = dom(f"{base}/notebooks/04_scheduler/")
        assert "<h1" in page and "continuous batching" in page and "Exercises" in page
        assert "data:image/png;base64" in page  # the scheduler timeline figure
        shot = artifacts / "notebook-04-scheduler.png"
        subprocess.run([browser, *flags, f"--screenshot={shot}", f"{base}/notebooks/04_scheduler/"],
                       capture_output=True, timeout=120)
        assert shot.is_file() and shot.stat().st_size > 10_000
    finally:
        server.terminate()
        server.wait(timeout=10)
