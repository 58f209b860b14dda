"""docs/architecture.md's "## Module map" names every module, so a reader finds any subsystem in one hop.

The rule, read from the first cell of each table row (the second cell says what the files are for):

    `minivllm/engine/core/scheduler.py`            a path from the repository root names that file
    `minivllm/engine/request/journal.py`, `errors.py`
                                              a bare file name continues the folder of the path before
                                              it in the same cell: here minivllm/engine/request/errors.py
    `minivllm/engine/`                        a folder (ending in "/") heads a group of rows; it names
                                              no file, so each file still needs a row of its own
    `minivllm.kernels`                        anything else in backquotes (a dotted name) is prose

Every file that MAPPED_FILES matches must be named, and everything named must exist (a row left
behind by a rename fails too). Nothing is skipped: when a folder is reorganised, its rows change with
it in the same commit.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# {folder from the repository root: the file patterns the map must cover}. kernels/ is installed as
# minivllm.kernels; its C++ sources and shared header are listed as well as its Python modules.
MAPPED_FILES = {"minivllm": ("*.py",), "kernels": ("*.py", "*.cpp", "*.h")}
FILE_SUFFIXES = (".py", ".cpp", ".h")


def mapped_files() -> set[str]:
    """Every file the map must name, as a path from the repository root; a package's __init__.py is
    its folder, not a module of its own, so it needs no row."""
    return {path.relative_to(ROOT).as_posix()
            for folder, patterns in MAPPED_FILES.items() for pattern in patterns
            for path in (ROOT / folder).rglob(pattern) if path.name != "__init__.py"}


def module_map_rows(markdown: str) -> list[str]:
    """The first cell of each row of the table under "## Module map" (up to the next heading)."""
    section = markdown.split("\n## Module map\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [row.split("|")[1] for row in rows[2:]]  # after the header and its |---| line


def named_paths(cell: str) -> tuple[set[str], set[str]]:
    """(files, folders) that one first cell names, by the rule of the module docstring."""
    files, folders, folder = set(), set(), None
    for name in re.findall(r"`([^`]+)`", cell):
        if name.endswith("/"):
            folders.add(name.rstrip("/"))
            folder = name.rstrip("/")
        elif "/" in name:
            files.add(name)
            folder = name.rsplit("/", 1)[0]
        elif name.endswith(FILE_SUFFIXES):
            assert folder is not None, f"bare file name {name!r} with no path before it in: {cell.strip()}"
            files.add(f"{folder}/{name}")
    return files, folders


def test_the_module_map_names_every_module_and_nothing_else():
    files, folders = set(), set()
    for cell in module_map_rows(ARCHITECTURE.read_text()):
        cell_files, cell_folders = named_paths(cell)
        files |= cell_files
        folders |= cell_folders
    missing = sorted(mapped_files() - files)
    assert not missing, "docs/architecture.md's module map has no row for: " + ", ".join(missing)
    stale = sorted(p for p in files if not (ROOT / p).is_file()) + sorted(
        f"{d}/" for d in folders if not (ROOT / d).is_dir())
    assert not stale, "docs/architecture.md's module map names what does not exist: " + ", ".join(stale)


def test_the_rule_reads_paths_bare_names_and_folders():
    assert named_paths(" `minivllm/engine/request/journal.py`, `errors.py` ") == (
        {"minivllm/engine/request/journal.py", "minivllm/engine/request/errors.py"}, set())
    assert named_paths(" `kernels/` (installed as `minivllm.kernels`) ") == (set(), {"kernels"})
    assert named_paths("`kernels/rms_norm.py`, `rms_norm.cpp`; `minivllm/layers/norm.py`, `rotary.py`")[0] == {
        "kernels/rms_norm.py", "kernels/rms_norm.cpp", "minivllm/layers/norm.py", "minivllm/layers/rotary.py"}
    table = "# A\n## Module map\n\n| module | role |\n|---|---|\n| `a/b.py` | x |\n| `c/` | y |\n\n## Next\n| `d.py` |"
    assert module_map_rows(table) == [" `a/b.py` ", " `c/` "]
    assert "minivllm/llm.py" in mapped_files() and "kernels/cpu_simd.h" in mapped_files()
    assert "minivllm/__init__.py" not in mapped_files()
