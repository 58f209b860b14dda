"""What a hands-on submission may not use: the engine's own implementation of the part it writes.

The rubric (docs/hands-on.md) scores 0 a solution that calls or subclasses the engine's own
implementation: a backend that hands its batch to `TorchAttentionBackend` passes every probe and
teaches nothing. The graders refuse it, naming the rule, by three checks that cover for each other:

  1. the source, before it runs (`check_source`): an import of a refused module or name under any alias,
     a star import from the project (it hides what it brings in), an attribute with a refused name
     (`sampler.TopKTopPMinP`), or a string naming one (`import_module("...")`, `getattr(m, "...")`);
  2. the classes it defines (`check_classes`): no refused class anywhere in their MRO;
  3. the calls (`Watch`, in teaching/submission_watch.py): while the grader runs the student's code, a
     trace hook sees every Python function called, so a refused implementation reached any other way (an
     alias or a name built at run time, a helper that calls it) is named too; it also records each Triton
     launch, for the kernel assignment's rule that it launches a kernel of its own.

What is refused, per part (`RULES`): the modules that implement it (refused whole, submodules too),
named objects in the modules a student does import (the seam's base class sits beside the engine's
default), every project subclass of the seam (found at check time), and the graders themselves
(minivllm.teaching, tests/). The engine's checkers (`CheckedFilter`, ...) are refused in the source and
the MRO but not in the watch: the grader runs them around the student's code.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from types import CodeType


GRADER_MODULES = ("minivllm.teaching", "tests")  # the graders and the reference solutions


class AssignmentError(AssertionError):
    """A student's part broke a rule of its seam or gave the engine a wrong answer (the rule is in the message).
    Defined here, the bottom of the graders, so every grader (teaching/hands_on.py and the capstone's) raises
    one type."""


PROJECT = ("minivllm", "kernels", "tests")  # a star import from these hides what it brings in


@dataclass(frozen=True)
class SubmissionRules:
    """What one part's submission may not import, call or subclass."""

    part: str  # the assignment, as `grade_hands_on` names it
    summary: str  # what is refused, as a student reads it in the rule
    seam: str | None  # dotted path of the base class a submission subclasses (allowed; its project subclasses are
    # not), or None where the part is plain functions (the speed assignment)
    modules: tuple[str, ...]  # refused whole, submodules included
    names: tuple[str, ...] = ()  # dotted paths of refused objects inside modules a submission may import
    wrappers: tuple[str, ...] = ()  # the engine's checkers: refused in source and MRO, but they run around the student
    own_kernel: bool = False  # the part must launch a @triton.jit function defined in its own file

    @property
    def rule(self) -> str:
        return (f"the {self.part} assignment is written by you: a submission may not import, call or subclass the "
                f"engine's own implementation of it ({self.summary}) nor the graders ({', '.join(GRADER_MODULES)})")


_ATTENTION = ("TorchAttentionBackend, TritonAttentionBackend, PerRowAttentionBackend, get_attention_backend, "
              "naive_paged_attention and every kernel in kernels/, the CPU ops in minivllm/cpu/ and "
              "torch.ops.minivllm_cpu")
_ATTENTION_MODULES = tuple("minivllm.layers." + m for m in ("torch_attention", "triton_attention", "per_row_attention",
                                                             "attention")) + ("minivllm.cpu", "kernels")
_SEAM = "minivllm.layers.attention_interface.AttentionBackend"
_SAMPLER, _BLOCKS, _POLICY = ("minivllm.layers.sampler.", "minivllm.engine.core.block_allocator.",
                              "minivllm.engine.core.scheduling_policy.")
RULES = {
    "attention": SubmissionRules("attention", _ATTENTION, _SEAM, _ATTENTION_MODULES, ("torch.ops.minivllm_cpu",)),
    "kernel": SubmissionRules("kernel", _ATTENTION, _SEAM, _ATTENTION_MODULES, ("torch.ops.minivllm_cpu",),
                              own_kernel=True),
    "filter": SubmissionRules(
        "filter", "apply_top_k_top_p_min_p, TopKTopPMinP, filtered_probs, CheckedFilter, the samplers, kernels/",
        _SAMPLER + "SamplingFilter", ("kernels",),
        tuple(_SAMPLER + n for n in ("apply_top_k_top_p_min_p", "TopKTopPMinP", "filtered_probs", "Sampler",
                                     "TritonSampler")), (_SAMPLER + "CheckedFilter",)),
    "allocator": SubmissionRules(
        "allocator", "LRUAllocator, JournaledAllocator, CheckedAllocator, get_allocator, kernels/",
        "minivllm.seams.BlockAllocator", ("kernels",),
        tuple(_BLOCKS + n for n in ("LRUAllocator", "JournaledAllocator", "get_allocator")),
        (_BLOCKS + "CheckedAllocator",)),
    "speed": SubmissionRules(
        "speed", "skinny_gemm, pack_skinny_weight, every kernel in kernels/ and torch.ops.minivllm_cpu: copying them "
        "would score the engine's speed, not yours", None, ("minivllm.kernels", "kernels"),
        ("minivllm.kernels.skinny_gemm.skinny_gemm", "minivllm.kernels.skinny_gemm.pack_skinny_weight",
         "torch.ops.minivllm_cpu")),
    "policy": SubmissionRules(
        "policy", "PriorityPolicy, FCFSPolicy, CheckedPolicy, get_policy, kernels/", "minivllm.seams.SchedulingPolicy",
        ("kernels",), tuple(_POLICY + n for n in ("PriorityPolicy", "FCFSPolicy", "get_policy")),
        (_POLICY + "CheckedPolicy",)),
}


def _resolve(dotted: str) -> object | None:
    """The object at `dotted` (module, then attributes), or None where it does not exist."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _in(module: str, modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in modules)


@dataclass(frozen=True)
class Refused:
    """The rules resolved to objects: the classes refused in an MRO, names refused in source, the code
    objects refused at run time."""

    classes: frozenset[type]
    short_names: frozenset[str]
    codes: dict[CodeType, str]  # code object -> "module.qualname" of a refused function or method (not the checkers')


@functools.cache
def refused(rules: SubmissionRules) -> Refused:
    for module in rules.modules:  # imported so that their seam subclasses are found below
        _resolve(module)
    seam = _resolve(rules.seam) if rules.seam else None
    found, todo = set(), list(seam.__subclasses__()) if isinstance(seam, type) else []
    while todo:  # every subclass of the seam, at any depth
        cls = todo.pop()
        if cls not in found:
            found.add(cls)
            todo += cls.__subclasses__()
    project = {c for c in found if _in(c.__module__, PROJECT)}
    named = [_resolve(n) for n in rules.names]
    checkers = {_resolve(n) for n in rules.wrappers} | {c for c in project if _in(c.__module__, GRADER_MODULES)}
    classes = {c for c in named if isinstance(c, type)} | project | {c for c in checkers if isinstance(c, type)}
    codes = {}
    for obj in [o for o in named if o is not None] + [c for c in project if c not in checkers]:
        for fn in list(vars(obj).values()) if isinstance(obj, type) else [obj]:
            code = _code_of(fn)
            if code is not None:
                codes[code] = f"{getattr(obj, '__module__', '?')}.{code.co_qualname}"
    short = {n.rsplit(".", 1)[-1] for n in rules.names + rules.wrappers} | {c.__name__ for c in classes}
    return Refused(frozenset(classes), frozenset(short), codes)


def _code_of(fn: object) -> CodeType | None:
    """The Python code object behind a function, method, property or @triton.jit function (else None)."""
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    elif isinstance(fn, property):
        fn = fn.fget
    if not inspect.isfunction(fn):
        fn = inspect.getattr_static(fn, "fn", None)  # a @triton.jit function keeps the Python one in .fn
    return fn.__code__ if inspect.isfunction(fn) else None


def _docstrings(tree: ast.AST) -> set[int]:  # the ids of the docstring nodes: prose may name anything
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
    return ids


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` of an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def source_violations(source: str, rules: SubmissionRules) -> list[str]:
    """What in `source` uses a refused module or name: one line each, with its line number."""
    short, modules = refused(rules).short_names, rules.modules + GRADER_MODULES
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"`import {a.name}`") for a in node.names if _in(a.name, modules)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                said = f"`from {node.module} import {a.name}{' as ' + a.asname if a.asname else ''}`"
                if a.name == "*" and _in(node.module, PROJECT):
                    found.append((node.lineno, f"{said} (name what you import: a star import hides whether it brings "
                                               "in the engine's own implementation)"))
                elif _in(node.module, modules) or _in(f"{node.module}.{a.name}", modules) or a.name in short:
                    found.append((node.lineno, said))
        elif isinstance(node, ast.Attribute) and (node.attr in short or _in(_dotted(node) or "", modules)):
            found.append((node.lineno, f"`{_dotted(node) or '(...).' + node.attr}`"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and \
                (node.value in short or _in(node.value, modules)):
            found.append((node.lineno, f"the string {node.value!r} (it names a refused module or object)"))
    return [f"line {n}: {text}" for n, text in sorted(set(found))]


def check_source(path: str | Path, rules: SubmissionRules) -> None:
    """Raise `AssignmentError` naming the rule if the file at `path` imports or names a refused object."""
    found = source_violations(Path(path).read_text(), rules)
    if found:
        raise AssignmentError(f"{path} broke a RULE: {rules.rule}.\n  " + "\n  ".join(found[:6]))


def check_classes(module: object, rules: SubmissionRules) -> None:
    """Raise `AssignmentError` if a class `module` defines has a refused class (or a refused module's) in its MRO."""
    refused_classes, modules = refused(rules).classes, rules.modules + GRADER_MODULES
    for cls in [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]:
        for base in cls.__mro__[1:]:
            if base in refused_classes or _in(base.__module__, modules):
                raise AssignmentError(f"{cls.__name__} broke a RULE: {rules.rule}.\n  it subclasses "
                                      f"{base.__module__}.{base.__qualname__} (its MRO: "
                                      f"{[b.__name__ for b in cls.__mro__]})")
