"""pyproject.toml lists minivllm's packages by hand (kernels/ is installed as minivllm.kernels), so a new
subpackage must be added there: an editable install (the README's) finds it anyway, a wheel would not."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_of_the_tree_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "minivllm").rglob("__init__.py")
               if "kernels" not in init.parent.relative_to(ROOT).parts}
    on_disk.add("minivllm.kernels")  # kernels/, mapped by package-dir
    assert on_disk == listed, f"missing from pyproject: {sorted(on_disk - listed)}; stale: {sorted(listed - on_disk)}"


def test_the_notebooks_extra_installs_what_the_course_imports():
    """The syllabus installs `.[notebooks]`: every module the notebooks and exercises/ import comes from
    the standard library, minivllm, a core dependency or that extra (httpx for notebook 10, pytest and
    hypothesis for the exercises and the capstone)."""
    import ast
    import importlib.metadata
    import json
    import re
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["notebooks"]
    allowed = {re.split(r"[<>=;\[ ]", req, 1)[0].lower().replace("_", "-") for req in wanted}
    sources = ["\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"]
                         if c["cell_type"] == "code")
               for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    sources += [py.read_text() for py in sorted((ROOT / "exercises").rglob("*.py"))]
    modules = set()
    for source in sources:
        tree = compile(source, "<course>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    dists = importlib.metadata.packages_distributions()
    missing = {}
    local = {"minivllm"} | {py.stem for py in (ROOT / "exercises").rglob("*.py")}  # student.py, grade.py, ...
    for module in sorted(modules - set(sys.stdlib_module_names) - local):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & allowed:
            missing[module] = sorted(names)
    assert not missing, f"imported by the course but not installed by .[notebooks]: {missing}"
