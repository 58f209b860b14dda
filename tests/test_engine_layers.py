"""The engine's layers (docs/architecture.md, "Module map"): which subpackage of minivllm/engine/ may import
which. Checked on every import a module makes or reaches through other modules, type-checking imports
included: a type named across a line ties the two sides together as much as a call does.

    request/      the data both sides share: imports no other subpackage of the engine (a `Sequence` names
                  its detokenizer and grammar matcher for type checkers only: TYPE_NAMES_ONLY)
    processing/   nothing of core/ or worker/
    core/         (the scheduler's side) nothing of worker/ or executor/
    worker/, executor/
                  (the runner's side) nothing of core/
The two sides meet in request/step_types.py. And with type-checking imports counted too, minivllm's modules
import each other without a cycle (tests/test_layering.py checks the graph of what runs).
"""

from __future__ import annotations

import ast

from test_layering import find_cycles, import_graph, module_files

ENGINE = "minivllm.engine"
LAYERS = ("request", "processing", "structured_output", "core", "worker", "executor", "spec_decode", "metrics")
FORBIDDEN = {"request": tuple(layer for layer in LAYERS if layer != "request"), "processing": ("core", "worker"),
             "core": ("worker", "executor"), "worker": ("core",), "executor": ("core",)}
# {module: the engine modules it names for type checkers only, and may}: the objects a Sequence carries.
TYPE_NAMES_ONLY = {f"{ENGINE}.request.sequence": {f"{ENGINE}.processing.detokenizer",
                                                   f"{ENGINE}.structured_output.grammar"}}


def layer_of(module: str) -> str | None:
    """The engine layer a module is in ("" for the engine's top), None outside the engine."""
    if module != ENGINE and not module.startswith(ENGINE + "."):
        return None
    first = module.removeprefix(ENGINE).lstrip(".").split(".")[0]
    return first if first in LAYERS else ""


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, itself or through the modules it imports."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), set()) - seen:
            seen.add(target)
            todo.append(target)
    return seen


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """"a reaches b" for each module a of a layer that reaches a module b of a layer FORBIDDEN to it."""
    bad = []
    for module in sorted(graph):
        forbidden = FORBIDDEN.get(layer_of(module) or "-", ())
        bad += [f"{module} reaches {target}" for target in sorted(reached(graph, module))
                if layer_of(target) in forbidden]
    return bad


def full_graph() -> dict[str, set[str]]:
    """minivllm's import graph with type-checking imports, less the TYPE_NAMES_ONLY edges."""
    graph = import_graph(module_files(), walk=lambda tree: list(ast.walk(tree)))
    return {m: targets - TYPE_NAMES_ONLY.get(m, set()) for m, targets in graph.items()}


def test_each_layer_imports_only_the_layers_it_may():
    assert layer_violations(full_graph()) == []


def test_the_type_only_names_are_type_only_and_their_modules_import_no_engine():
    runs = import_graph(module_files())
    for module, names in TYPE_NAMES_ONLY.items():
        assert not runs[module] & names, f"{module} imports {sorted(runs[module] & names)} when it runs"
        for name in names:
            assert not {t for t in reached(runs, name) if layer_of(t) is not None}, f"{name} imports the engine"


def test_the_scheduler_and_the_model_runner_meet_in_the_step_types():
    graph = full_graph()
    step_types = f"{ENGINE}.request.step_types"
    assert step_types in graph[f"{ENGINE}.core.scheduler"] and step_types in graph[f"{ENGINE}.worker.model_runner"]


def test_no_import_cycle_with_type_checking_imports_counted():
    cycles = find_cycles(import_graph(module_files(), walk=lambda tree: list(ast.walk(tree))))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles)


def test_the_rules_see_imports_of_imports():
    core, request, worker = (f"{ENGINE}.{layer}.m" for layer in ("core", "request", "worker"))
    graph = {core: {request}, request: {worker}, worker: set(), f"{ENGINE}.llm_engine": {core, worker}}
    assert layer_violations(graph) == [f"{core} reaches {worker}", f"{request} reaches {worker}"]
    assert layer_of(ENGINE) == "" and layer_of("minivllm.layers.sampler") is None
