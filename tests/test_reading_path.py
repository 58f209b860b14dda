"""docs/architecture.md's "## Reading path" lists the files one plain request's step needs, and says how many
lines they make: that number must stay true (within 5 %), so the README's promise is checked, not hoped."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reading_path() -> tuple[list[Path], int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Reading path", 1)[1].split("\n## ", 1)[0]
    files = [ROOT / m for m in re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.M)]
    stated = int(re.search(r"About ([\d,]+) lines", section).group(1).replace(",", ""))
    return files, stated


def test_the_reading_path_names_real_files_and_its_line_count_is_true():
    files, stated = reading_path()
    assert len(files) >= 10 and all(f.is_file() for f in files), [str(f) for f in files if not f.is_file()]
    total = sum(len(f.read_text().splitlines()) for f in files)
    assert abs(total - stated) <= 0.05 * stated, f"the reading path is {total} lines; docs/architecture.md says {stated}"
    readme = (ROOT / "README.md").read_text()
    assert f"about {stated:,} lines" in readme, "the README states the reading path's length as the docs do"
