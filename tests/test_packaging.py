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
