"""Where the tuner's choices are kept between processes: one JSON file per machine setting.

    $MINIVLLM_CACHE/tuning/choices-<digest>.json     (MINIVLLM_TUNING_CACHE names another folder)

A timing is only evidence about the setting it was taken in, so the file's name is a digest of that
setting (`MachineKey`): the CPU's model name, the kernels' build key (kernels/cpu_build.py: the CPU's
instruction-set flags, torch's version, the C++ sources, headers and compiler flags), torch's thread
count, the torch and minivllm versions, and the instruction-set caps set for torch's libraries
(ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS). Change any of them and the process reads another file,
so it measures afresh. Inside the file, each chooser's entry is named after what it was measured on
(dtype and shapes, e.g. "norm_rope float32 hidden 576 heads 9+3 dim 64"): two models, or two
tensor-parallel ranks with shards of different shapes, never read each other's entries.

Two processes may measure the same entry at once (two ranks of one shape, a notebook beside a
server). Each measures on its own, then `record` re-reads the file under an exclusive `flock` and
writes only if the entry is still missing; the one that finds it there already adopts it. So both
run with the same choice, and the file is written by one process at a time, whole: it is written to
a temporary file beside it and moved into place with `os.replace`, which a reader sees either before
or after, never half-done.

Anything the cache cannot use counts as absent: it is ignored with one warning, measured again and
rewritten; no file stops a start until someone deletes it. Here: a path that is not a regular file (a
symbolic link is not followed, a FIFO is never waited on, a link to /dev/zero never read), a file over
16 MiB (ours are a few KiB), a file that is not UTF-8, not JSON
(cut short by a full disk), nested too deep for the parser, or of another layout; an entry whose
choices are not a candidate name and a speed-up per timed candidate (positive, finite numbers). The
tuner (tuner.py) then checks an entry's meaning: its names and candidates must be the chooser's.
The lock file is opened without following a symbolic link (O_NOFOLLOW): a link planted there never
makes the cache create or lock a file elsewhere; the write then fails and the start measures anyway.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch

from minivllm.kernels.cpu_build import build_key
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.model_cache import cache_root

FORMAT = 1  # bumped when the file's layout changes: older files are then another file, not a corrupt one
log = logging.getLogger("minivllm")
MAX_FILE_BYTES = 16 << 20  # a choice file is a few KiB: anything larger is not one of ours, and is never read whole
LIBRARY_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


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
    # torch's libraries' own instruction-set caps: oneDNN capped at AVX2 runs other kernels (and refuses bf16
    # packing), so a timing taken under a cap is no evidence without it (minivllm's own cap is in `kernels`)
    library_caps: str = ""

    @classmethod
    def here(cls) -> MachineKey:
        caps = " ".join(f"{name}={os.environ[name]}" for name in LIBRARY_CAPS if os.environ.get(name))
        return cls(CpuInfo.read().model_name, build_key(), torch.get_num_threads(), torch.__version__,
                   importlib.metadata.version("minivllm"), caps)

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
        """The entry if the file holds a well-formed one; None (after a warning if it was unusable) if not."""
        return self._read().get(entry)

    def record(self, entry: str, decided: Entry, overwrite: bool = False,
               usable: Callable[[Entry], bool] = lambda stored: True) -> Entry:
        """Save `decided` as `entry` unless another process saved a `usable` one first (then return theirs,
        which the caller adopts); `overwrite` (tuning='remeasure', or a stored entry found unusable)
        replaces it either way."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            entries = self._read(quiet=True)  # lookup has said what was wrong with the file, once
            if entry in entries and not overwrite and usable(entries[entry]):
                return entries[entry]
            entries[entry] = decided
            self._write(entries)
            return decided

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive `flock` on a lock file beside the choices: the OS lets go when the holder exits,
        however it exits, so no stale lock remains. Held for a read and a write, milliseconds. Opened
        with O_NOFOLLOW: a symbolic link there (dangling or not) raises ELOOP, an OSError the tuner
        reports, instead of creating or locking the file it points to."""
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read(self, quiet: bool = False) -> dict[str, Entry]:
        """The well-formed entries of the file; {} for a missing or unreadable file. What is dropped is
        said in a warning unless `quiet`."""
        try:
            # RecursionError: a file nested thousands deep; UnicodeDecodeError is a ValueError, as is json's;
            # OSError: a symbolic link (ELOOP) or a file we may not read
            data = json.loads(_read_regular_file(self.path).decode("utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"not a format-{FORMAT} choice file")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as error:
            if not quiet:
                log.warning("ignoring the tuning cache %s, which cannot be read (%s); the kernels are measured "
                            "again and the file rewritten", self.path, _short(error))
            return {}
        entries: dict[str, Entry] = {}
        for entry, decided in data["entries"].items():
            problem = malformed(decided)
            if problem is None:
                entries[entry] = decided
            elif not quiet:
                log.warning("ignoring the entry %.200r of the tuning cache %s (%.300s); it is measured again "
                            "and rewritten", entry, self.path, problem)
        return entries

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


def malformed(decided: object) -> str | None:
    """What makes an entry unusable by any chooser, or None: each stored choice must name a candidate and
    give every timed candidate a positive, finite speed-up (the file is text: anything may be there)."""
    if not isinstance(decided, dict) or not decided:
        return "not a non-empty set of choices"
    for name, stored in decided.items():
        if not isinstance(stored, dict) or not isinstance(stored.get("chosen"), str):
            return f"choice {name!r} names no candidate"
        speedups = stored.get("speedups")
        if not isinstance(speedups, dict) or not speedups:
            return f"choice {name!r} has no timed candidates"
        if not all(type(v) in (int, float) and 0 < v < math.inf for v in speedups.values()):  # NaN fails too
            return f"choice {name!r} has a speed-up that is not a positive number: {speedups!r}"[:200]
    return None


def _read_regular_file(path: Path) -> bytes:
    """The bytes of `path` if it is a regular file of at most MAX_FILE_BYTES; ValueError if not. Opened
    without following a link (O_NOFOLLOW) and without waiting for a writer (O_NONBLOCK: a FIFO planted
    there would block every start in `open`); the type and size come from the open file (fstat), so
    nothing can be swapped in between the check and the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        raw = f.read(MAX_FILE_BYTES + 1)  # never more: the file may grow after the fstat
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return raw


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:200]
