"""The tuner: of several equal ways to compute one thing, keep the fastest on this machine, once.

Four places in minivllm have a choice that only timing can settle, because the answer differs from
one CPU to the next: the matmul form of each weight shape and row bucket (matmul_plan.py), RMSNorm
and RoPE as torch ops or C++ kernels (norm_rope_kernels.py), decode attention as gather + SDPA or a
C++ kernel (layers/torch_attention.py), and greedy argmax likewise (layers/sampler.py). Each states its candidates
(the first is the default, its fixed rule) and its probes (inputs of the sizes it meets); `choose`
does the rest, the same way for all four:

    tuning="cached" (default)   the entry is in the cache file (tuning_cache.py): reuse it, time nothing;
                                else time, decide, save
    tuning="remeasure"          time, decide, save over what the file held
    tuning="off"                time nothing: the default candidate, as when there is no warm-up

Timing (`time_candidates`): each probe runs every candidate once to warm up, then `repeats` rounds
that alternate between the candidates, so a drift in the machine (another process starting) hits
them all alike; each keeps its best round. A candidate's speed-up is the default's time over its
own, at its WORST probe: it must win everywhere it will run. Deciding (`decide`): the fastest
candidate replaces the default only if it is faster by more than `margin`; ties and noise keep the
default.

A cached entry is used only if it is one this chooser could have made here: the same decision names,
each `chosen` among that decision's candidates, and a speed-up for exactly the candidates timed here
(`unusable`). Anything else (a hand edit, a form this CPU cannot run, a kernel no longer built) is
ignored with a warning, measured again and written over; a start never stops on its cache file.

Why cache: timing is noisy, so re-measuring at every start made the arithmetic (which matmul form
sums which way) depend on the noise of the moment: the same greedy request gave different text in
two processes on one machine. With the cache, one machine and one set of options run the same
kernels in every process until someone asks to re-measure. It also saved most of a start's time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from minivllm.cpu.tuning_cache import Entry, StoredChoice, TuningCache

Tuning = Literal["cached", "remeasure", "off"]
TUNING_MODES: tuple[Tuning, ...] = ("cached", "remeasure", "off")
MARGIN = 0.05  # a candidate must be at least 5 % faster than the default to replace it
Probe = Callable[[str], object]  # runs the named candidate once, on inputs made beforehand
log = logging.getLogger("minivllm")


@dataclass(frozen=True)
class Choice:
    """What a chooser runs, and why: the candidate kept, the timings behind it and where they came from."""

    chosen: str
    default: str  # the fixed rule: what runs untimed
    speedups: dict[str, float]  # per timed candidate but the default: the default's time / its time ({}: untimed)
    source: str  # "measured", "cached" (timed by an earlier or concurrent process), or why nothing was timed
    subject: str = ""  # what was chosen, in words: "decode attention and K/V writes"
    probes: str = ""  # the inputs it was timed on, in words: "16 rows x 128 keys, 2 rows x 1024 keys"

    def __str__(self) -> str:
        """The line warm-up logs and `minivllm bench` prints, e.g. "greedy sampling: kernel (vs argmax_rows:
        kernel 1.80x at worst of 32 rows x 49152, 1 rows x 49152, cached)"."""
        return f"{self.subject}: {self.chosen} ({self.detail(self.probes)})"

    def about(self, subject: str, probes: str = "") -> Choice:
        """This choice, saying what it chose and on which inputs."""
        return replace(self, subject=subject, probes=probes)

    @property
    def used(self) -> bool:
        """Whether something other than the default runs."""
        return self.chosen != self.default

    def detail(self, probes: str = "") -> str:
        """e.g. "vs torch: kernels 1.31x at worst of 32, 1 rows, measured" or "tuning off"."""
        if not self.speedups:
            return self.source
        timed = ", ".join(f"{name} {s:.2f}x" for name, s in self.speedups.items())
        return f"vs {self.default}: {timed} at worst{f' of {probes}' if probes else ''}, {self.source}"


def untimed(default: str, why: str) -> Choice:
    """The default, and why nothing was timed (no kernels built, a dtype the kernel lacks, tuning off)."""
    return Choice(default, default, {}, why)


def forced(candidates: Sequence[str], chosen: str, why: str) -> Choice:
    """A choice made by hand, not by timing (tests that run one path whatever this machine would measure)."""
    if chosen not in candidates:
        raise ValueError(f"{chosen!r} is not one of the candidates {tuple(candidates)}")
    return Choice(chosen, candidates[0], {}, why)


def time_candidates(candidates: Sequence[str], probes: Sequence[Probe], repeats: int = 5) -> dict[str, float]:
    """Per candidate but the first (the default): the default's time / its time, at its worst probe."""
    worst: dict[str, float] = {}
    for probe in probes:
        best = dict.fromkeys(candidates, math.inf)
        for round_ in range(repeats + 1):  # round 0 warms up (first calls, allocations) and is not counted
            for name in candidates:
                t0 = time.perf_counter()
                probe(name)
                if round_:
                    best[name] = min(best[name], time.perf_counter() - t0)
        for name in candidates[1:]:
            worst[name] = min(worst.get(name, math.inf), best[candidates[0]] / best[name])
    return worst


def decide(default: str, speedups: dict[str, float], margin: float = MARGIN) -> str:
    """The fastest candidate if it beats the default by more than `margin`, else the default."""
    if not speedups:
        return default
    fastest = max(speedups, key=speedups.__getitem__)
    return fastest if speedups[fastest] > 1 + margin else default


def choose(entry: str, candidates: Sequence[str], probes: Callable[[], Sequence[Probe]], tuning: Tuning,
           margin: float = MARGIN, repeats: int = 5) -> Choice:
    """One decision, named `entry` in the cache (say what it was measured on: dtype, shapes). `probes`
    makes the inputs only if timing happens: a cached start builds nothing."""
    decided = choose_many(entry, lambda: {"": time_candidates(candidates, probes(), repeats)}, tuning, margin,
                          candidates={"": candidates})
    return decided.get("", untimed(candidates[0], "tuning off"))


def choose_many(entry: str, measure: Callable[[], dict[str, dict[str, float]]], tuning: Tuning,
                margin: float = MARGIN, *, candidates: Mapping[str, Sequence[str]]) -> dict[str, Choice]:
    """Several decisions measured together (the matmul plan times all its shapes in one pass over the
    weights): `measure` returns each one's speed-ups (over its default) by name, and `candidates` names,
    per decision, every candidate `measure` times for it here, its default first (each decision has its
    own: the matmul plan's depends on the dtype and the row count); a cached entry is held to them.
    Empty with tuning='off'."""
    if tuning not in TUNING_MODES:
        raise ValueError(f"tuning={tuning!r} is invalid: choose one of {TUNING_MODES}")
    if tuning == "off":
        return {}
    cache = TuningCache()
    if tuning == "cached":
        try:
            stored = cache.lookup(entry)
        except OSError as error:
            log.warning("cannot read the tuning cache %s (%s): measuring instead", cache.path, error)
            stored = None
        problem = None if stored is None else unusable(stored, candidates)
        if stored is not None and problem is None:
            log.info("tuning: %s, read from %s", entry, cache.path)
            return _choices(stored, candidates, "cached")
        if problem is not None:
            log.warning("ignoring the tuning cache's entry %r in %s (%.300s); it is measured again and "
                        "rewritten", entry, cache.path, problem)
    decided: Entry = {name: StoredChoice(chosen=decide(candidates[name][0], speedups, margin), speedups=speedups)
                      for name, speedups in measure().items()}
    try:  # another process's entry is adopted only if usable here; an unusable one is written over
        kept = cache.record(entry, decided, overwrite=tuning == "remeasure",
                            usable=lambda theirs: unusable(theirs, candidates) is None)
    except OSError as error:
        log.warning("cannot write the tuning cache %s (%s): the next start measures again; point "
                    "MINIVLLM_TUNING_CACHE or MINIVLLM_CACHE at a writable folder", cache.path, error)
        kept = decided
    log.info("tuning: %s, measured%s, saved in %s", entry, "" if kept is decided else " (another process saved "
             "its own first: adopted)", cache.path)
    return _choices(kept, candidates, "measured" if kept is decided else "cached")


def unusable(stored: Entry, candidates: Mapping[str, Sequence[str]]) -> str | None:
    """Why a (well-formed: tuning_cache.malformed) stored entry is not one this chooser could have made
    here, or None: each decision must be one it makes, chosen among its candidates, timed over exactly
    its candidates but its default, the first (another set, or another default, was another contest: a
    form this CPU cannot run, a kernel not built here)."""
    for name, choice in stored.items():
        if name not in candidates:
            return f"{name!r} is not a decision of this chooser"
        timed = set(candidates[name][1:])
        if set(choice["speedups"]) != timed:
            return f"{name!r} was timed over {sorted(choice['speedups'])}, not over {sorted(timed)}"
        if choice["chosen"] not in candidates[name]:
            return f"{name!r} chose {choice['chosen']!r}, not one of {sorted(candidates[name])}"
    return None


def _choices(stored: Entry, candidates: Mapping[str, Sequence[str]], source: str) -> dict[str, Choice]:
    return {name: Choice(s["chosen"], candidates[name][0], dict(s["speedups"]), source) for name, s in stored.items()}
