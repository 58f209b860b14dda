"""The dependency rules between folders, checked on every import statement (inside functions too):

    kernels/          imports nothing from minivllm (it is installed as `minivllm.kernels`, so only a
                      one-dot relative import `from .x import y` may reach a sibling kernel module)
    minivllm/layers/  imports nothing from minivllm/models/ (models are built from layers, not back)
    minivllm/         (the engine: everything outside teaching/) imports nothing from minivllm/teaching/,
                      the code of the notebooks and the course; one exception, `minivllm bench`, which
                      times a tiny random checkpoint (teaching/checkpoints.py) when given no model
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, a module of `package`; relative
    imports are resolved against `package`, `from a import b` yields both `a` and `a.b`, and an
    import_module("...") / __import__("...") call with a literal name counts as an import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    found.append((node.lineno, "<relative import above the top package>"))
                    continue
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return sorted(found, key=lambda item: item[0])  # ast.walk is breadth-first


def violations(folder: Path, package: str, forbidden: str, skip: str | None = None) -> list[str]:
    """Imports of `forbidden` (a module or any of its submodules) by the .py files under `folder`,
    but those in its subfolder `skip`."""
    bad = []
    for path in sorted(folder.rglob("*.py")):
        sub = path.relative_to(folder).parent.parts
        if skip is not None and sub[:1] == (skip,):
            continue
        for line, name in imported_modules(path.read_text(), ".".join((package, *sub))):
            if name == forbidden or name.startswith(forbidden + ".") or name.startswith("<"):
                bad.append(f"{folder.name}/{path.relative_to(folder)}:{line} imports {name}")
    return bad


def test_kernels_import_nothing_from_minivllm():
    # Resolved as the folder's own package `kernels`: `from .seeding import x` stays inside it.
    assert violations(ROOT / "kernels", "kernels", "minivllm") == []


def test_layers_import_nothing_from_models():
    assert violations(ROOT / "minivllm" / "layers", "minivllm.layers", "minivllm.models") == []


# The engine's only use of the teaching code, {file: module}: `minivllm bench` without --model times a
# tiny random checkpoint, built by the notebooks' own function (it is a command, not the engine).
ENGINE_USES_OF_TEACHING = {"minivllm/entrypoints/bench.py": "minivllm.teaching.checkpoints"}


def test_the_engine_imports_nothing_from_teaching():
    found = violations(ROOT / "minivllm", "minivllm", "minivllm.teaching", skip="teaching")

    def allowed(violation: str) -> bool:
        file, name = violation.split(":")[0], violation.split(" imports ")[1]
        module = ENGINE_USES_OF_TEACHING.get(file)
        return module is not None and (name == module or name.startswith(module + "."))

    assert [v for v in found if not allowed(v)] == []


def test_the_checker_sees_nested_relative_and_dynamic_imports(tmp_path):
    (tmp_path / "k.py").write_text(
        "from .seeding import noise_seed\n"
        "def f():\n    from minivllm.layers.sampler import noise_seed\n"
        "def g():\n    import minivllm.kernels.sampling\n"
        "def h():\n    return importlib.import_module('minivllm.models')\n"
        "from .. import models\n")
    found = violations(tmp_path, "kernels", "minivllm")
    assert [f.split(":")[1].split()[0] for f in found] == ["3", "3", "5", "7", "8"]
    (tmp_path / "k.py").write_text("def f():\n    from ..models import hf_config\n")
    assert len(violations(tmp_path, "minivllm.layers", "minivllm.models")) == 2  # module and module.name
    (tmp_path / "k.py").write_text("from .rotary import RopeSpec\nfrom minivllm.layers import linear\n")
    assert violations(tmp_path, "minivllm.layers", "minivllm.models") == []
    (tmp_path / "teaching").mkdir()
    (tmp_path / "teaching" / "t.py").write_text("from minivllm.teaching import viz\n")
    assert len(violations(tmp_path, "minivllm", "minivllm.teaching")) == 2
    assert violations(tmp_path, "minivllm", "minivllm.teaching", skip="teaching") == []
