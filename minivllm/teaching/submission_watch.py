"""The watch on a hands-on submission's calls: the third of the submission rules' checks (submission_rules.py).

The source check and the MRO check see what a file names; a name built at run time
(`importlib.import_module("minivllm." + "kern" + "els")`, `getattr(m, "sk" + "inny_gemm")`) gets past both. So
while the grader runs the student's code, a trace hook (`sys.settrace`) sees every new Python frame and names any
that belongs to a refused function or module, however it was reached. Invariants:

- it is opened around the student's code only: the grader calls the references (which live in refused modules)
  itself, outside it;
- it costs one hook call per Python frame (no line events), and a Triton launch is not traced inside (the
  interpreter makes thousands of calls per program): the function launched says whose kernel it is, and every
  launch is recorded so the kernel assignment can check its own kernel was launched (`check_own_kernel`);
- C functions are not seen: the engine's compiled ops are refused by name in the source, and the speed grader
  watches the dispatcher for them (perf_speed.EngineOps);
- a trace function already set (a debugger, coverage) is put back on exit.

    with Watch(RULES["filter"]) as watch:      # around each call into the student's code
        out = student(logits, sampling)
    watch.check(who)                           # raises AssignmentError naming the rule
"""

from __future__ import annotations

import sys

from torch.utils._python_dispatch import _disable_current_modes

from minivllm.teaching.submission_rules import AssignmentError, SubmissionRules, refused


def _launchers() -> tuple[type, ...]:  # Triton's kernel classes: `kernel[grid](...)` ends in their `run`
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return ()
    return JITFunction, InterpretedFunction


class Watch:
    """While open, every new Python frame is checked against the refused code objects and modules, and
    every Triton launch is recorded (`run` of Triton's kernel classes is wrapped; a launch's inside is not
    traced: the interpreter makes thousands of calls a program, and the function launched says whose
    kernel it is). Open it around the student's code only: the grader calls the references itself. A
    trace function already set (a debugger, coverage) is put back on exit. C functions are not seen (the module
    docstring says what sees them)."""

    def __init__(self, rules: SubmissionRules) -> None:
        self.rules = rules
        self._codes = refused(rules).codes
        self._prefixes = tuple(m + "." for m in rules.modules)
        self._modules = frozenset(rules.modules)
        self.calls: list[str] = []  # refused functions called, in order
        self.launched: list[object] = []  # the JIT functions launched

    def _refused_module(self, module: str) -> bool:
        return module in self._modules or module.startswith(self._prefixes)

    def _trace(self, frame, event, arg) -> None:  # sys.settrace's global hook: called for each new Python frame
        code = frame.f_code
        if code in self._codes:
            self.calls.append(self._codes[code])
        else:
            module = frame.f_globals.get("__name__") or ""
            if self._refused_module(module):  # a module's own code runs when it is first imported
                self.calls.append(f"{module} (imported)" if code.co_name == "<module>" else
                                  f"{module}.{code.co_qualname}")

    def _launch(self, run):
        def launch(kernel, *args, **kwargs):
            self.launched.append(kernel)
            module = getattr(getattr(kernel, "fn", None), "__module__", "") or ""
            if self._refused_module(module):
                self.calls.append(f"{module}.{kernel.fn.__qualname__} (a kernel launch)")
            tracer = sys.gettrace()
            sys.settrace(None)  # the launch itself is not traced (see the class docstring)
            try:
                with _disable_current_modes():  # nor are its torch ops recorded (host_ops.py): the kernel's
                    return run(kernel, *args, **kwargs)
            finally:
                sys.settrace(tracer)
        return launch

    def __enter__(self) -> Watch:
        self._runs = {cls: cls.__dict__["run"] for cls in _launchers()}
        for cls, run in self._runs.items():
            cls.run = self._launch(run)
        self._before = sys.gettrace()
        sys.settrace(self._trace)  # returns None: no line events, so a watched call costs one hook per frame
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._before)
        for cls, run in self._runs.items():
            cls.run = run

    def check(self, who: str) -> None:
        """Raise `AssignmentError` naming the rule if the student's code called a refused implementation."""
        if self.calls:
            raise AssignmentError(f"{who} broke a RULE: {self.rules.rule}.\n  while the grader ran your code, it "
                                  f"called {self.calls[0]}")

    def check_own_kernel(self, who: str, module_name: str) -> None:
        """Raise `AssignmentError` unless a @triton.jit function defined in `module_name` was launched."""
        names = [getattr(getattr(f, "fn", None), "__module__", None) for f in self.launched]
        if module_name not in names:
            shown = sorted({f"{getattr(f.fn, '__module__', '?')}.{getattr(f.fn, '__name__', '?')}"
                            for f in self.launched if hasattr(f, "fn")}) or "none"
            raise AssignmentError(f"{who} broke a RULE: the kernel assignment is a Triton kernel: paged_attention "
                                  f"launches a @triton.jit function defined in your file (kernel[grid](...)); "
                                  f"the kernels it launched: {shown}")
