"""The dependency rules between folders, checked on every import statement (inside functions too):

    kernels/          imports nothing from minivllm (it is installed as `minivllm.kernels`, so only a
                      one-dot relative import `from .x import y` may reach a sibling kernel module)
    minivllm/         no import cycle between its modules (kernels/ included, as `minivllm.kernels`)
    minivllm/layers/  imports nothing from minivllm/models/ (models are built from layers, not back)
    minivllm/cpu/     (the CPU tuning wing) imports nothing from minivllm/models/ or the engine; the layers and
                      models import nothing from it: warm-up attaches its choices to a built model from
                      outside (cpu/attach.py), so the arrows run engine -> cpu -> layers, engine -> models
                      -> layers. No exception: the attention backend and the sampler hold their kernel
                      switches too, set by cpu/decode_kernels.py
    minivllm/distributed/, layers/, models/
                      import nothing from minivllm/engine/: the process groups and the command channel
                      are the low layer the layers use too; the engine's executors and workers sit on
                      top (engine/executor/). One exception: `python -m minivllm.distributed`, a
                      command that nothing imports, starts the engine's worker
    engine/           layered in subpackages: request/ (the data both sides share) at the bottom, core/ the
                      scheduler's side, worker/ and executor/ the runner's; they meet only in
                      engine/request/step_types.py (tests/test_engine_layers.py: which may import which)
    minivllm/         (the engine: everything outside teaching/) imports nothing from minivllm/teaching/,
                      the code of the notebooks and the course; one exception, `minivllm bench`, which
                      times a tiny random checkpoint (teaching/checkpoints.py) when given no model
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def from_module(node: ast.ImportFrom, package: str) -> str | None:
    """The absolute name of the module a `from ... import` statement of `package` reads from; None for
    a relative import that climbs above the top package."""
    if not node.level:
        return node.module
    parts = package.split(".")
    if node.level > len(parts):
        return None
    return ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, a module of `package`; relative
    imports are resolved against `package`, `from a import b` yields both `a` and `a.b`, and an
    import_module("...") / __import__("...") call with a literal name counts as an import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_module(node, package)
            if base is None:
                found.append((node.lineno, "<relative import above the top package>"))
                continue
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


def test_layers_and_models_import_nothing_from_cpu_and_cpu_nothing_from_models_or_the_engine():
    for folder in ("layers", "models"):
        assert violations(ROOT / "minivllm" / folder, f"minivllm.{folder}", "minivllm.cpu") == []
    for forbidden in ("minivllm.models", "minivllm.engine"):
        assert violations(ROOT / "minivllm" / "cpu", "minivllm.cpu", forbidden) == []


def test_model_files_carry_no_tuning_plumbing():
    """A model file reads like its HF counterpart: no plan, no tuner, no kernel choice threaded through it."""
    for path in sorted((ROOT / "minivllm" / "models").glob("*.py")):
        text = path.read_text()
        for word in ("MatmulPlan", "matmul_plan", "plan_matmuls", "NormRopeKernels", "Tuning", "DirectCall",
                     "plan=", "batch_invariance"):
            assert word not in text, f"models/{path.name} mentions {word}"


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


def test_distributed_layers_and_models_import_nothing_from_the_engine():
    found = [v for folder in ("distributed", "layers", "models")
             for v in violations(ROOT / "minivllm" / folder, f"minivllm.{folder}", "minivllm.engine")]
    assert [v for v in found if not v.startswith("distributed/__main__.py:")] == []


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


# --- the import graph: no cycles ---


def is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`: its body is read by type checkers, never run."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def runtime_nodes(node: ast.AST) -> list[ast.AST]:
    """Every node below `node` that can run, i.e. all but the bodies of `if TYPE_CHECKING:` blocks
    (their `else:` runs)."""
    found: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        found.append(child)
        if is_type_checking_block(child):
            found += [n for orelse in child.orelse for n in [orelse, *runtime_nodes(orelse)]]
        else:
            found += runtime_nodes(child)
    return found


def module_files() -> dict[str, Path]:
    """{module name: file} for minivllm/ and kernels/ (installed as minivllm.kernels)."""
    modules: dict[str, Path] = {}
    for folder, top in ((ROOT / "minivllm", "minivllm"), (ROOT / "kernels", "minivllm.kernels")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":  # a package's module is named after its folder
                parts = parts[:-1]
            modules[".".join((top, *parts))] = path
    return modules


def import_graph(modules: dict[str, Path], walk: Callable[[ast.AST], list[ast.AST]] = runtime_nodes
                 ) -> dict[str, set[str]]:
    """{module: the modules of `modules` it imports when it runs}. `import a.b` is an edge to a.b;
    `from a import b` is one to a.b when a.b is a module, else to a (b is a name defined in a). `walk`: the nodes
    read, those that run (the default) or all (`ast.walk`: type-checking imports too)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = from_module(node, package) or "<above the top package>"
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
                targets.add(node.args[0].value)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per edge that closes a loop, found by depth-first search with three colours: white
    (not reached), grey (on the current path), black (done). An edge to a grey module closes a loop:
    the path from that module to here. Each cycle is returned from its smallest name, so the same loop
    found from two places is reported once. Not every loop of a tangle is listed (a loop through
    modules already done is not walked again), but every tangle shows at least one: break it, rerun."""
    colour = {name: "white" for name in graph}
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        colour[name] = "grey"
        path.append(name)
        for target in sorted(graph[name]):
            if colour[target] == "grey":
                loop = path[path.index(target):]
                start = loop.index(min(loop))
                cycles.append(loop[start:] + loop[:start])
            elif colour[target] == "white":
                visit(target)
        path.pop()
        colour[name] = "black"

    for name in sorted(graph):
        if colour[name] == "white":
            visit(name)
    return sorted({tuple(c): c for c in cycles}.values())


def test_minivllm_modules_import_each_other_without_cycles():
    cycles = find_cycles(import_graph(module_files()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles)


def test_the_cycle_search_sees_function_level_and_dynamic_imports_but_not_type_checking():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"d2"}, "d2": {"d"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"], ["d", "d2"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minivllm import x\n"
              "else:\n    import minivllm.y\n"
              "def f():\n    from . import z\n    return importlib.import_module('minivllm.w')\n")
    nodes = runtime_nodes(ast.parse(source))
    imported = [n.names[0].name for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imported == ["TYPE_CHECKING", "minivllm.y", "z"]
    assert any(isinstance(n, ast.Constant) and n.value == "minivllm.w" for n in nodes)


def test_the_import_graph_resolves_packages_and_skips_type_checking(tmp_path):
    files = {"pkg/__init__.py": "from pkg.a import VALUE\n",
             "pkg/a.py": "from pkg import b\nfrom . import c\nVALUE = 1\n",
             "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
             "pkg/c.py": "def f():\n    from pkg import VALUE\n    import pkg.b\n"}
    modules = {}
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        (tmp_path / relative).write_text(text)
        name = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        modules[name] = tmp_path / relative
    graph = import_graph(modules)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.c"}, "pkg.b": set(), "pkg.c": {"pkg", "pkg.b"}}
    assert find_cycles(graph) == [["pkg", "pkg.a", "pkg.c"]]
