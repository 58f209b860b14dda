"""Where the tuner's choices are kept between processes: one JSON file per machine setting.

    $MINIVLLM_CACHE/tuning/choices-<digest>.json     (MINIVLLM_TUNING_CACHE names another folder)

A timing is only evidence about the setting it was taken in, so the file's name is a digest of that
setting (`MachineKey`): the CPU's model name, the kernels' build key (kernels/cpu_build.py: the CPU's
instruction-set flags, torch's version, the C++ sources, headers and compiler flags), torch's thread
count, and the torch and minivllm versions. Change any of them and the process reads another file,
so it measures afresh. Inside the file, each chooser's entry is named after what it was measured on
(dtype and shapes, e.g. "norm_rope float32 hidden 576 heads 9+3 dim 64"): two models, or two
tensor-parallel ranks with shards of different shapes, never read each other's entries.

Two processes may measure the same entry at once (two ranks of one shape, a notebook beside a
server). Each measures on its own, then `record` re-reads the file under an exclusive `flock` and
writes only if the entry is still missing; the one that finds it there already adopts it. So both
run with the same choice, and the file is written by one process at a time, whole: it is written to
a temporary file beside it and moved into place with `os.replace`, which a reader sees either before
or after, never half-done. A file that cannot be parsed (a disk that filled up, a hand edit) is
ignored with a warning and replaced at the next write.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch

from minivllm.kernels.cpu_build import build_key
from minivllm.layers.cpu_info import CpuInfo
from minivllm.model_cache import cache_root

FORMAT = 1  # bumped when the file's layout changes: older files are then another file, not a corrupt one
log = logging.getLogger("minivllm")


class StoredChoice(TypedDict):
    """One decision as the file holds it: the candidate kept and every timed candidate's speed-up."""

    chosen: str
    speedups: dict[str, float]  # the default's time / this candidate's time, at its worst probe


Entry = dict[str, StoredChoice]  # one chooser's decisions, by name (one name, or one per matmul shape and bucket)


@dataclass(frozen=True)
class MachineKey:
    """Everything a timing depends on besides the entry's own dtype and shapes."""

    cpu: str  # /proc/cpuinfo's model name
    kernels: str  # kernels/cpu_build.py's build key: CPU flags, torch, sources, headers, compiler flags
    threads: int  # torch.get_num_threads(): a matmul on 1 thread and on 8 are different contests
    torch: str
    minivllm: str

    @classmethod
    def here(cls) -> MachineKey:
        return cls(CpuInfo.read().model_name, build_key(), torch.get_num_threads(), torch.__version__,
                   importlib.metadata.version("minivllm"))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def tuning_folder() -> Path:
    """The folder of the choice files, read from the environment at each call (tests use their own)."""
    return Path(os.environ.get("MINIVLLM_TUNING_CACHE") or cache_root() / "tuning")


class TuningCache:
    """The choice file of one `MachineKey`: `lookup` an entry, `record` one (first writer wins)."""

    def __init__(self, machine: MachineKey | None = None, folder: Path | None = None) -> None:
        self.machine = MachineKey.here() if machine is None else machine
        self.path = (tuning_folder() if folder is None else folder) / f"choices-{self.machine.digest()}.json"

    def lookup(self, entry: str) -> Entry | None:
        return self._read().get(entry)

    def record(self, entry: str, decided: Entry, overwrite: bool = False) -> Entry:
        """Save `decided` as `entry` unless another process saved it first (then return theirs, which the
        caller adopts); `overwrite` (tuning='remeasure') replaces it either way."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            entries = self._read()
            if entry in entries and not overwrite:
                return entries[entry]
            entries[entry] = decided
            self._write(entries)
            return decided

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive `flock` on a lock file beside the choices: the OS lets go when the holder exits,
        however it exits, so no stale lock remains. Held for a read and a write, milliseconds."""
        with open(self.path.with_suffix(".lock"), "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Entry]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"not a format-{FORMAT} choice file")
            entries: dict[str, Entry] = data["entries"]
            for decided in entries.values():  # the shape every reader relies on, checked once here
                for stored in decided.values():
                    if not isinstance(stored["chosen"], str) or not all(
                            isinstance(v, (int, float)) for v in stored["speedups"].values()):
                        raise ValueError(f"a malformed choice: {stored!r}")
            return entries
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            log.warning("ignoring the tuning cache %s, which cannot be read (%s); the kernels are measured "
                        "again and the file rewritten", self.path, error)
            return {}

    def _write(self, entries: dict[str, Entry]) -> None:
        data = {"format": FORMAT, "machine": asdict(self.machine), "entries": entries}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)  # atomic: a reader sees the old file or the new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
