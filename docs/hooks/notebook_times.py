"""A hook of the docs build: how long each notebook took to execute, printed in the build log.

The syllabus promises a time per notebook; this line is where that promise is checked, in every
build, on the machine that builds:

    INFO    -  notebook notebooks/09_engine_end_to_end.ipynb: 41.2 s wall, 48.0 s CPU (2 cores; load average 0.4)

mkdocs-jupyter executes a notebook inside the page's `render` (it replaces `Page.render` in its own
`on_pre_page`); this hook runs after it (a lower priority) and wraps that render with a clock. The
CPU time is the build's own plus its children's: the notebook's kernel is a child process, counted
once it has exited (a kernel's own children, such as a tensor-parallel worker, once it reaped them).
CPU time above wall time means the notebook used more than one core. The load average says how busy
the machine was: on a shared machine, wall time is the figure that grows.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from typing import Any

from mkdocs.plugins import event_priority

log = logging.getLogger("mkdocs.hooks.notebook_times")


def _cpu_s() -> float:
    """User + system seconds of this process and of its children that have exited."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@event_priority(-100)  # after mkdocs-jupyter's on_pre_page (priority 0) has set its render
def on_pre_page(page: Any, config: Any, files: Any) -> Any:
    if not page.file.src_uri.endswith(".ipynb"):
        return page
    render = page.render

    def timed_render(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), _cpu_s()
        result = render(*args, **kwargs)
        wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        log.info(f"notebook {page.file.src_uri}: {wall:.1f} s wall, {cpu:.1f} s CPU "
                 f"({cores} cores; load average {os.getloadavg()[0]:.1f})")
        return result

    page.render = timed_render
    return page
