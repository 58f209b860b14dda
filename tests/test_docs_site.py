"""The notebooks and the docs site: notebooks committed clean and in the house shape, the figures
readable, the site built --strict (which executes every notebook, failing on any error), and three
pages checked in headless Chromium (one of them a new notebook, screenshot kept as an artifact)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from html import unescape
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


MAX_CODE_LINE = 88  # what a code cell shows at the site's width (1280 px screen) without scrolling


def test_notebooks_committed_without_outputs_and_in_shape():
    assert len(NOTEBOOKS) >= 15
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), f"{path.name} has outputs"
        text = "\n".join("".join(c["source"]) for c in nb["cells"])
        for section in ("What you will learn", "## Experiment", "## Exercises"):
            assert section in text, f"{path.name} lacks '{section}'"
        assert "from minivllm" in text, f"{path.name} must call the package"
        long = [line for c in code for line in "".join(c["source"]).splitlines() if len(line) > MAX_CODE_LINE]
        assert not long, f"{path.name}: code lines over {MAX_CODE_LINE} characters are cut on the site: {long[:2]}"
        diagrams = [block for c in nb["cells"] if c["cell_type"] == "markdown"
                    for block in "".join(c["source"]).split("```")[1::2]]  # fenced blocks: ASCII diagrams
        wide = [line for block in diagrams for line in block.splitlines() if len(line.rstrip()) > MAX_CODE_LINE]
        assert not wide, f"{path.name}: diagram lines over {MAX_CODE_LINE} characters are cut on the site: {wide[:2]}"



DOCS = ROOT / "docs"
STUDENT_PAGES = ("index.md", "getting-started.md", "syllabus.md", "hands-on.md", "submitting.md")
COURSE_INSTALL = 'pip install -e ".[notebooks]" jupyterlab'
COUNT_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight")
NUMBER_WORDS = {w: n for n, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                            "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty"
                                            .split())}


def test_course_pages_keep_answers_with_the_teachers_and_agree():
    """A student page links to no answer and names no solution file; every hands-on part (a numbered
    folder of exercises/hands_on) is on the student pages and in the answer key, counted alike; every
    install line of the course is the same one."""
    parts = sorted(d.name for d in (ROOT / "exercises" / "hands_on").glob("[0-9]_*") if d.is_dir())
    key = (DOCS / "answer-key.md").read_text()
    assert "## Hands-on track" in key
    for i in range(1, len(parts) + 1):
        assert re.search(rf"^### {i} · ", key, re.M), f"answer-key.md has no answer for hands-on part {i}"
    for name in STUDENT_PAGES:
        text = (DOCS / name).read_text()
        assert "answer-key.md" not in text, f"{name} (a student page) links to the answer key"
        assert "_solutions" not in text, f"{name} (a student page) names a solution file"
        assert not re.search(r"^#+ Answer", text, re.M), f"{name} (a student page) holds answers"
        counts = re.findall(r"\b(\w+) (?:hands-on parts|assignments)\b|\b(?:of|in) (\w+) parts\b", text, re.I)
        counts = [word for pair in counts for word in pair if word]
        wrong = {c for c in counts if c.lower() in COUNT_WORDS and c.lower() != COUNT_WORDS[len(parts) - 1]}
        assert not wrong, f"{name} counts the hands-on parts as {wrong}; there are {len(parts)}"
        installs = re.findall(r"pip install -e \S+(?: jupyterlab)?", text)
        course = [line for line in installs if "notebooks" in line or "jupyterlab" in line]
        assert all(line == COURSE_INSTALL for line in course), f"{name}: {course}, not {COURSE_INSTALL!r}"
    for name in (*STUDENT_PAGES, "teachers.md"):  # the notebooks, counted in words or digits
        for word in re.findall(r"\b(\w+) (?:notebooks|runnable walk-throughs)\b", (DOCS / name).read_text()):
            count = int(word) if word.isdigit() else NUMBER_WORDS.get(word.lower())
            assert count in (None, len(NOTEBOOKS)), f"{name} counts {word} notebooks; there are {len(NOTEBOOKS)}"
    for name in ("hands-on.md", "submitting.md"):
        text = (DOCS / name).read_text()
        missing = [part for part in parts if f"{part}/" not in text]
        assert not missing, f"{name} does not name the starters {missing}"


def _fake_trace():
    from minivllm.engine.metrics.trace import ScheduledTrace, StepTrace

    def step(i, scheduled, preempted=()):
        return StepTrace(i, tuple(scheduled), tuple(preempted), (), {"a": (0, 1), "b": (2,)}, (3, 4), frozenset({0}), 6)

    return [step(0, [ScheduledTrace("a", 0, 5, True, True), ScheduledTrace("b", 0, 3, True, True)]),
            step(1, [ScheduledTrace("a", 5, 5, False, True, 4, 2)], preempted=["b"]),
            step(2, [ScheduledTrace("a", 8, 1, False, True)]),
            step(3, [ScheduledTrace("a", 9, 5, False, True, 4, 4), ScheduledTrace("b", 0, 4, True, True)])]


class _FakeTokenizer:
    def decode(self, ids, **kwargs):
        return " ".join(f"t{i}" for i in ids)


def _fake_beam_search():
    """Three steps of a width-2 search on made-up logprobs: a beam pruned, one completed by EOS (id 0)."""
    from minivllm.beam_search import BeamSearch, BeamSearchParams
    from minivllm.outputs import CompletionOutput, Logprob, RequestOutput

    def out(top):
        lps = {t: Logprob(lp, r) for r, (t, lp) in enumerate(top.items(), start=1)}
        return RequestOutput("r", None, [1], [CompletionOutput(0, "", [next(iter(top))], "length", None, 0.0, [lps])], True)

    search = BeamSearch([1, 2], BeamSearchParams(2, 3), frozenset({0}))
    search.advance([out({5: -0.5, 6: -0.9, 7: -2.0, 8: -3.0})])
    search.advance([out({0: -0.2, 9: -0.4, 10: -2.0, 11: -3.0}), out({12: -0.1, 13: -2.0, 14: -3.0, 15: -4.0})])
    search.advance([out({16: -0.3, 17: -0.6, 18: -2.0, 19: -3.0}), out({20: -0.2, 21: -2.5, 22: -3.0, 23: -4.0})])
    return search


def test_figures_are_readable_at_the_site_width():
    """Every picture of teaching.viz and cost_viz: text of 8 pt or more, steps on integer ticks, 8 inches wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from minivllm.models.sharding import WeightSlice
    from minivllm.teaching import beam_viz, cost_viz, viz
    from minivllm.teaching.step_cost import DecodeRun, OpProfile, OpTime

    class Seq:
        def __init__(self, rid, table, n):
            self.request_id, self.block_table, self.num_tokens = rid, table, n

    trace = _fake_trace()
    drawings = {
        "timeline": lambda: viz.plot_timeline(trace),
        "block_map": lambda: viz.plot_block_map(trace[1]),
        "acceptance": lambda: viz.plot_acceptance(trace),
        "static": lambda: viz.plot_static_batches([3, 7, 2, 5, 4], 2),
        "slots": lambda: viz.plot_slot_map([12, 13, 36], [0, 1, 8], [2, 1], ["a", "b"], 16, 4),
        "tables": lambda: viz.plot_block_tables([Seq("p", [7, 2, 9], 11), Seq("c", [7, 2, 4], 11)],
                                                [0, 0, 2, 0, 1, 0, 0, 2, 0, 1], 4),
        "distributions": lambda: viz.plot_distributions({"p": [0.5, 0.5], "q": [0.9, 0.1]}, ["x", "y"]),
        "shards": lambda: viz.plot_weight_shards(  # by rows, by columns, and a replicated KV head
            {"q": (8, 4), "k": (2, 4), "o": (4, 8)},
            {"q": [WeightSlice(0, 0, 4), WeightSlice(0, 4, 8)], "k": [WeightSlice(0, 0, 2)] * 2,
             "o": [WeightSlice(1, 0, 4), WeightSlice(1, 4, 8)]}),
    }
    drawings["beam_tree"] = lambda: beam_viz.plot_beam_tree(_fake_beam_search(), _FakeTokenizer())
    run = DecodeRun(batch=1, steps=16, wall_s=0.4, step_s=0.39, forward_s=0.37)
    profile = OpProfile(steps=4, wall_s=0.2, ops=[OpTime("mkldnn::_linear_pointwise", 480, 0.08),
                                                  OpTime("aten::mul", 900, 0.02), OpTime("aten::add", 300, 0.01)])
    drawings.update({
        "step_split": lambda: cost_viz.plot_step_split({"1 row": run, "32 rows": run._replace(batch=32)}),
        "top_ops": lambda: cost_viz.plot_top_ops(profile),
        "floor": lambda: cost_viz.plot_bandwidth_floor([cost_viz.FloorRow("float32", 538_000_000, 26.0),
                                                        cost_viz.FloorRow("bfloat16", 269_000_000, 24.0)], 46.0),
        "roofline": lambda: cost_viz.plot_roofline([cost_viz.RooflinePoint("bfloat16", 1, 1.0, 11.0),
                                                    cost_viz.RooflinePoint("bfloat16", 32, 32.0, 155.0)],
                                                   46.0, {"float32": 195.0, "bfloat16": 420.0}),
    })
    for name, draw in drawings.items():
        ax = draw()
        fig = ax.figure
        fig.canvas.draw()
        assert abs(fig.get_figwidth() - viz.WIDTH) < 1e-6, name
        sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
        assert sizes and min(sizes) >= 8, f"{name}: text of {min(sizes)} pt"
        if ax.get_xlabel() == "step":
            labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
            assert labels and all(lbl.lstrip("−-").isdigit() for lbl in labels), f"{name}: step ticks {labels}"
        plt.close(fig)


@pytest.fixture(scope="module")
def site(tmp_path_factory, pytestconfig) -> Path:
    """The built site: $MINIVLLM_SITE_DIR if CI built it already, else built here (executes notebooks)."""
    prebuilt = os.environ.get("MINIVLLM_SITE_DIR")
    if prebuilt and (Path(prebuilt) / "index.html").is_file():
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=3600)  # only a hang: 6 min here, 3x that busy
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    show_notebook_times(r.stdout + r.stderr, pytestconfig)
    return out


def show_notebook_times(build_log: str, config: pytest.Config) -> None:
    """The syllabus's times are checked in every build (docs/hooks/notebook_times.py logs one line a
    notebook); pytest captures the build's log, so those lines are written to the test run's own output."""
    times = [line.split("notebook ", 1)[1] for line in build_log.splitlines() if "-  notebook notebooks/" in line]
    assert len(times) == len(NOTEBOOKS), f"the build logged {len(times)} notebook times for {len(NOTEBOOKS)} notebooks"
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # a fixture's output is otherwise captured, then dropped
            reporter.write_line("")
            for line in times:
                reporter.write_line(f"docs build: {line}")


def test_site_has_every_section(site):
    for page in ("index.html", "getting-started/index.html", "architecture/index.html",
                 "concepts/paged-kv/index.html", "guides/server/index.html", "reference/engine/index.html",
                 "teachers/index.html", "syllabus/index.html", "answer-key/index.html",
                 "notebooks/01_request_life/index.html", "notebooks/13_speculative_decoding/index.html",
                 "notebooks/14_tensor_parallelism/index.html", "notebooks/15_cost_of_a_step/index.html"):
        assert (site / page).is_file(), page
    engine_ref = (site / "reference/engine/index.html").read_text()
    assert "check_invariants" in engine_ref  # mkdocstrings rendered the docstrings
    for nb in NOTEBOOKS:
        html = (site / "notebooks" / nb.stem / "index.html").read_text()
        assert "data:image/png;base64" in html, f"{nb.stem} rendered no figure"
        # tqdm.auto's warning without ipywidgets (filtered in each notebook's first cell)
        assert "Please update jupyter and ipywidgets" not in html, f"{nb.stem} shows tqdm's IProgress warning"


MAX_PRINTED_LINE = 100  # what an output block shows at the site's width without scrolling
_OUTPUT_TEXT = re.compile(r'<div class="jp-RenderedText jp-OutputArea-output"[^>]*>\s*<pre>(.*?)</pre>', re.S)


def test_printed_lines_fit_the_site(site):
    """Every line a notebook printed (stdout, stderr, a cell's value), as executed by the build."""
    for nb in NOTEBOOKS:
        html = (site / "notebooks" / nb.stem / "index.html").read_text()
        printed = [unescape(re.sub(r"<[^>]+>", "", block)) for block in _OUTPUT_TEXT.findall(html)]
        assert printed, f"{nb.stem}: no printed output found (has the site's HTML changed?)"
        wide = [line for block in printed for line in block.splitlines() if len(line) > MAX_PRINTED_LINE]
        assert not wide, f"{nb.stem}: printed lines over {MAX_PRINTED_LINE} characters scroll on the site: {wide[:2]}"


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

        def notebook_page(slug: str, words: tuple[str, ...], figures: int) -> None:
            """The notebook's page renders its text and at least `figures` figures; a screenshot is kept."""
            page = dom(f"{base}/notebooks/{slug}/")
            assert "<h1" in page and all(w in page for w in words), slug
            assert page.count("data:image/png;base64") >= figures, slug
            shot = artifacts / f"notebook-{slug.replace('_', '-')}.png"
            subprocess.run([browser, *flags, f"--screenshot={shot}", f"{base}/notebooks/{slug}/"],
                           capture_output=True, timeout=120)
            assert shot.is_file() and shot.stat().st_size > 10_000, slug

        home = dom(f"{base}/index.html")
        assert "<h1" in home and "minivllm" in home and "architecture.svg" in home
        notebook_page("04_scheduler", ("continuous batching", "Exercises"), 1)  # the scheduler timeline
        # New notebook pages: speculative decoding (its histogram and the acceptance per step) and this
        # round's tensor parallelism (the weight-split figure).
        notebook_page("13_speculative_decoding", ("Speculative decoding", "Exercises"), 2)
        notebook_page("14_tensor_parallelism", ("Tensor parallelism", "all-reduce"), 1)
    finally:
        server.terminate()
        server.wait(timeout=10)
