"""Hands-on 3: grading a sampling filter (top-k, then top-p, then min-p) that the engine's sampler runs.

    check_filter_probes(MyFilter)       # the rules, one at a time, on random logits
    check_filter_in_engine(MyFilter)    # then LLM(sampling_filter=MyFilter()) draws the default's tokens

The seam is `SamplingFilter` (layers/sampler.py): (R, V) temperature-scaled logits and each row's
parameters in, the same logits with every removed token at -inf out. The sampler then draws from
softmax of what the filter returned, so what is graded is the DISTRIBUTION a row is drawn from:

  * which tokens are kept (the rest must be -inf), and
  * the probabilities of the kept ones (softmax of the returned row), which must be the model's own
    renormalised over the kept set. Returning log-probabilities is therefore as good as logits;
    returning probabilities, or rescaled logits, is not (a softmax of them is another distribution).

Each probe turns on one parameter (or all, or a mix per row) so that the first probe that fails names
the rule broken; the expected answer is the engine's own filter, `TopKTopPMinP`, asked for that probe's
parameters. Three probes aim at edges random logits never hit: a tie AT the k-th rank (ranks k and k + 1
equal: both stay), top tokens whose mass is EXACTLY top_p (probabilities 0.5, 0.25, 0.25 at top_p 0.5:
the second is removed), and rows at temperatures other than 1 (the sampler has already divided the
logits by the temperature: a filter that divides again keeps other tokens, or other probabilities; a
row there that differs in another way is named by its parameters' rule). Every probe also checks that
the filter changed neither the logits nor `sampling` in place.

Then the engine runs the filter: seeded sampling must give the tokens the default gives. There the
filter is compared with `TopKTopPMinP` on every call, on the engine's own logits, so a difference is
named by the rule of the row where it appears (its parameters and temperature say which), not just
"the tokens differ"; tokens that differ while every call agreed name the last rule, that a filter is
a function of its inputs alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.layers.sampler import CheckedFilter, SamplingFilter, SamplingRow, SamplingTensors, TopKTopPMinP
from minivllm.teaching.hands_on import AssignmentError, check_finished, tiny_model
from minivllm.teaching.submission_rules import RULES
from minivllm.teaching.submission_watch import Watch

# Probabilities of a float32 softmax over V = 64 logits: rounding stays < 64 * 1.2e-7 relative; 1e-5 is far
# above that and far below any mistake (a token wrongly kept or dropped moves others by >= 1e-3 here).
PROB_ATOL = 1e-5
VOCAB = 64

KEEP_RULE = "every row the sampler draws from keeps at least one token, and the shape stays (rows, vocabulary)"
DIST_RULE = ("a kept token keeps its probability relative to the other kept ones: return logits (or "
             "log-probabilities) with removed tokens at -inf, not probabilities or rescaled logits")
TEMPERATURE_RULE = ("the logits arrive already divided by each row's temperature (the sampler did it): the filter "
                    "must not apply the temperature again, so a row at temperature 0.5 or 2 keeps the tokens and "
                    "probabilities of the logits it is given")


@dataclass(frozen=True)
class FilterProbe:
    """Rows of random logits, each with (top_k, top_p, min_p); the rule a failure names."""

    name: str
    rule: str
    rows: tuple[tuple[int, float, float], ...]
    temperatures: tuple[float, ...] | None = None  # per row; None: 1 for every row
    tie_at_k: bool = False  # each row's ranks k and k + 1 hold equal logits
    exact: tuple[tuple[float, ...], ...] = ()  # per row its first probabilities, exact in float32 (the rest ~0)
    dist_rule: str = DIST_RULE  # the rule a difference in probabilities alone (the right tokens kept) names


FILTER_PROBES = (
    FilterProbe("off", "a row that asks for nothing (top_k 0 or V, top_p 1, min_p 0) keeps every token, with the "
                "model's probabilities", ((0, 1.0, 0.0), (VOCAB, 1.0, 0.0))),
    FilterProbe("top-k", "top-k keeps the k most likely tokens (and any tied with the k-th), removing the rest",
                ((1, 1.0, 0.0), (5, 1.0, 0.0), (40, 1.0, 0.0))),
    FilterProbe("top-k tie", "top-k keeps every token tied with the k-th, so a tie AT the k-th rank keeps more than k "
                "tokens (remove the tokens below the k-th logit, not all but the first k of a sort)",
                ((5, 1.0, 0.0), (1, 1.0, 0.0), (12, 1.0, 0.0)), tie_at_k=True),
    FilterProbe("top-p", "top-p keeps the most likely tokens until their probability mass reaches top_p, the "
                "token that crosses it included (so the top token is always kept)",
                ((0, 0.5, 0.0), (0, 0.9, 0.0), (0, 0.05, 0.0))),
    FilterProbe("top-p boundary", "top-p stops AT the token where the mass before it reaches top_p: a token is kept "
                "only while the mass of the tokens before it is < top_p, so when the top tokens sum to exactly top_p "
                "the next one is removed", ((0, 0.5, 0.0), (0, 0.75, 0.0)), exact=((0.5, 0.25, 0.25),
                                                                                (0.5, 0.25, 0.125, 0.125))),
    FilterProbe("min-p", "min-p keeps the tokens whose probability is at least min_p times the top token's",
                ((0, 1.0, 0.1), (0, 1.0, 0.5), (0, 1.0, 0.01))),
    FilterProbe("in order", "the three run in order, each on what the one before kept: top-p measures the mass "
                "of the tokens top-k kept, renormalised (and min-p compares with the top token of what is left)",
                ((10, 0.8, 0.0), (20, 0.6, 0.1), (5, 0.95, 0.2), (0, 0.9, 0.1), (0, 0.8, 0.05), (30, 0.7, 0.02))),
    FilterProbe("per row", "each row uses its own parameters, whatever the other rows of the batch ask",
                ((3, 1.0, 0.0), (0, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05), (1, 0.5, 0.5))),
    FilterProbe("temperature", TEMPERATURE_RULE, ((0, 0.8, 0.0), (0, 1.0, 0.1), (10, 0.9, 0.05), (0, 0.6, 0.0)),
                temperatures=(0.5, 2.0, 0.7, 1.5), dist_rule=TEMPERATURE_RULE),
)
PURE_RULE = ("a filter is a function of its inputs alone, and changes neither: `sampling` and `logits` are read by "
             "the sampler after it (a greedy row's temperature 0 is what keeps it greedy), and the same input gives "
             "the same output whatever came before (no state kept between calls, no random draws of its own)")


def tensors_for(rows: tuple[tuple[int, float, float], ...], temperatures: tuple[float, ...] | None = None
                ) -> SamplingTensors:
    temperatures = temperatures or (1.0,) * len(rows)
    params = [SamplingRow(t, k, p, m, seed=i, position=0) for i, ((k, p, m), t) in enumerate(zip(rows, temperatures))]
    return SamplingTensors.from_params(params, VOCAB, torch.device("cpu"))


def random_logits(num_rows: int, seed: int, tie: bool = False, tie_at: tuple[int, ...] = ()) -> torch.Tensor:
    """(R, V) logits spread like a small model's; `tie`: tokens 3 and 7 equal in every row (top-k's edge case.
    Not for top-p: which of two tied tokens a sort ranks first is the sort's choice, not a rule); `tie_at`:
    per row a k, whose (k+1)-th largest logit is set equal to its k-th."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=g) * 2.5  # (R, V)
    if tie:
        logits[:, 7] = logits[:, 3]
    for r, k in enumerate(tie_at):
        ranked = logits[r].argsort(descending=True)
        logits[r, ranked[k]] = logits[r, ranked[k - 1]]
    return logits


def row_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How one row's output (V,) differs from the reference's, or None: the tokens kept, then their probabilities."""
    kept, want_kept = got > float("-inf"), want > float("-inf")  # (V,) each
    if not torch.equal(kept, want_kept):
        extra = (kept & ~want_kept).nonzero()[:, 0].tolist()
        missing = (want_kept & ~kept).nonzero()[:, 0].tolist()
        return (f"kept {int(kept.sum())} tokens, expected {int(want_kept.sum())}; kept but should not: {extra[:8]}, "
                f"removed but should not: {missing[:8]}")
    diff = float((got.softmax(-1) - want.softmax(-1)).abs().nan_to_num(1.0).max())
    if diff > PROB_ATOL:
        return f"the right tokens are kept, but a probability differs by {diff:.3g} from the model's renormalised one"
    return None


def rule_of_row(k: int, p: float, m: float, vocab: int = VOCAB) -> str:
    """The rule a wrong row points to by its parameters: the one it turns on, or, several on, their order."""
    on = [n for n, active in (("top-k", 0 < k < vocab), ("top-p", p < 1.0), ("min-p", m > 0.0)) if active]
    return {probe.name: probe.rule for probe in FILTER_PROBES}["off" if not on else on[0] if len(on) == 1 else
                                                                "in order"]


def tempered_twice(got: torch.Tensor, logits: torch.Tensor, sampling: SamplingTensors, r: int) -> bool:
    """Whether row r of `got` is exactly what the reference gives on logits divided by the temperature again."""
    temps = torch.where(sampling.temperatures > 0, sampling.temperatures, 1.0)[:, None]  # (R, 1)
    return float(sampling.temperatures[r]) not in (0.0, 1.0) and \
        row_difference(got[r], TopKTopPMinP()(logits / temps, sampling)[r]) is None


def _compare(who: str, probe: FilterProbe, got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor,
             sampling: SamplingTensors) -> None:
    for r, (k, p, m) in enumerate(probe.rows):
        t = probe.temperatures[r] if probe.temperatures else 1.0
        differs = row_difference(got[r], want[r])
        if differs:  # a probability-only difference is DIST_RULE, except where the probe is about exactly that
            rule = probe.dist_rule if differs.startswith("the right") else probe.rule
            if probe.temperatures and not probe.name.startswith("random"):  # the temperature probe: twice, or?
                rule = TEMPERATURE_RULE if tempered_twice(got, logits, sampling, r) else \
                    DIST_RULE if differs.startswith("the right") else rule_of_row(k, p, m)
            raise AssignmentError(f"{who} broke a RULE: {rule}.\n  probe '{probe.name}', row {r} (top_k={k}, "
                                  f"top_p={p}, min_p={m}, temperature={t}): {differs}")


def check_filter_probes(make_filter: Callable[[], SamplingFilter], seed: int = 0) -> None:
    """Each probe through the student's filter (wrapped in the engine's `CheckedFilter`), then 100 random
    mixes, against the engine's `TopKTopPMinP`; raise `AssignmentError` naming the first rule broken."""
    checked, reference = CheckedFilter(make_filter()), TopKTopPMinP()
    who = type(checked.inner).__name__
    rng = torch.Generator().manual_seed(seed)
    probes = list(FILTER_PROBES)
    for i in range(100):  # random mixes: any k, p, m and temperature, several rows at once
        u = torch.rand(4, 3, generator=rng).tolist()  # top_p in [0.05, 1] (SamplingParams refuses 0), min_p in [0, 0.3]
        rows = tuple((int(torch.randint(0, VOCAB + 1, (), generator=rng)), round(0.05 + 0.95 * a, 2), round(0.3 * b, 2))
                     for a, b, _ in u)
        probes.append(FilterProbe(f"random mix {i}", "the same tokens and probabilities as the engine's TopKTopPMinP",
                                  rows, tuple(round(0.3 + 1.7 * c, 2) for _, _, c in u)))
    for n, probe in enumerate(probes):
        tie_at = tuple(k for k, _, _ in probe.rows) if probe.tie_at_k else ()
        logits = random_logits(len(probe.rows), seed + n, tie=probe.name == "top-k", tie_at=tie_at)
        for r, probs in enumerate(probe.exact):  # powers of two: softmax gives them back exactly in float32
            logits[r] = -50.0  # exp(-50) ~ 2e-22: the rest of the vocabulary adds nothing to the mass
            logits[r, :len(probs)] = torch.tensor(probs).log()
        t = tensors_for(probe.rows, probe.temperatures)
        watch, given = Watch(RULES["filter"]), logits.clone()
        params = [x.clone() for x in (t.temperatures, t.top_ks, t.top_ps, t.min_ps)]
        try:
            with watch:
                got = checked(given, t)
        except AssertionError as error:  # FilterContractError: the seam's own rules
            raise AssignmentError(f"{who} broke a RULE: {KEEP_RULE}.\n  probe '{probe.name}' {probe.rows}, which "
                                  f"checks that {probe.rule}: {error}") from None
        except NotImplementedError:
            raise
        except Exception as error:  # a crash on this probe's rows: named by the probe's rule
            watch.check(who)
            raise AssignmentError(f"{who} broke a RULE: {probe.rule}.\n  probe '{probe.name}' {probe.rows}: your code "
                                  f"raised {type(error).__name__}: {error}") from error
        watch.check(who)
        changed = [n for n, a, b in zip(("temperatures", "top_ks", "top_ps", "min_ps"), params,
                                        (t.temperatures, t.top_ks, t.top_ps, t.min_ps)) if not torch.equal(a, b)]
        what = [f"sampling.{n}" for n in changed] + ([] if torch.equal(given, logits) else ["logits"])
        if what:
            raise AssignmentError(f"{who} broke a RULE: {PURE_RULE}.\n  probe '{probe.name}': your filter changed "
                                  f"{what} in place (return a new tensor: out = logits.clone(), then edit out)")
        _compare(who, probe, got.float(), reference(logits.clone(), t), logits, t)


class ComparedFilter(SamplingFilter):
    """The student's filter inside the engine, compared on every call with `TopKTopPMinP` on the same input:
    `first_difference` keeps the first row that differs, named by the rule its parameters point to."""

    def __init__(self, inner: SamplingFilter) -> None:
        self.inner, self.name, self.reference = inner, inner.name, TopKTopPMinP()
        self.calls, self.first_difference = 0, None

    def __call__(self, logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        given = logits.clone()  # (R, V)
        params = [x.clone() for x in (sampling.temperatures, sampling.top_ks, sampling.top_ps, sampling.min_ps)]
        got = self.inner(logits, sampling)
        self.calls += 1
        if self.first_difference is None:
            changed = [name for name, before, after in zip(("temperatures", "top_ks", "top_ps", "min_ps"), params,
                       (sampling.temperatures, sampling.top_ks, sampling.top_ps, sampling.min_ps))
                       if not torch.equal(before, after)]
            if changed or not torch.equal(given, logits):
                what = [f"sampling.{n}" for n in changed] + ([] if torch.equal(given, logits) else ["logits"])
                self.first_difference = f"{PURE_RULE}.\n  call {self.calls}: your filter changed {what} in place"
            elif isinstance(got, torch.Tensor) and got.shape == given.shape:
                self.first_difference = self._diagnose(given, sampling, got.float())
        return got

    def _diagnose(self, logits: torch.Tensor, sampling: SamplingTensors, got: torch.Tensor) -> str | None:
        want = self.reference(logits.clone(), sampling)
        for r in range(got.shape[0]):
            t, k, p, m = (float(sampling.temperatures[r]), int(sampling.top_ks[r]), float(sampling.top_ps[r]),
                          float(sampling.min_ps[r]))
            differs = None if t <= 0 else row_difference(got[r], want[r])  # greedy: the argmax, whatever returned
            if differs is None:
                continue
            if tempered_twice(got, logits, sampling, r):
                rule = TEMPERATURE_RULE  # exactly what the temperature applied twice gives
            else:
                rule = DIST_RULE if differs.startswith("the right") else rule_of_row(k, p, m, logits.shape[1])
            return (f"{rule}.\n  call {self.calls} of your filter, row {r} (top_k={k}, top_p={p:g}, min_p={m:g}, "
                    f"temperature={t:g}), on the engine's own logits: {differs}")
        return None


def check_filter_in_engine(make_filter: Callable[[], SamplingFilter], max_tokens: int = 8) -> None:
    """LLM(sampling_filter=...) on a tiny random model: seeded sampling with top-k, top-p and min-p (and a greedy
    row among them) gives exactly the default engine's tokens. Every call of the filter is compared with the
    engine's own on the same input, so a difference names the rule of the row it appears in."""
    from minivllm import LLM, SamplingParams

    model_dir = tiny_model("qwen3")
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9] * 6, list(range(20, 37)), [40, 41, 42, 43], [3])]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=100 + i, max_tokens=max_tokens,
                             ignore_eos=True)
              for i, (t, k, p, m) in enumerate([(0.9, 0, 1.0, 0.0), (1.2, 20, 1.0, 0.0), (0.8, 0, 0.8, 0.0),
                                                (1.0, 50, 0.9, 0.05), (0.0, 0, 1.0, 0.0)])]

    def run(**kwargs) -> list[list[int]]:
        llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=64, warmup=False, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        check_finished(who, outs)
        return [o.outputs[0].token_ids for o in outs]

    student = ComparedFilter(make_filter())
    who = f"{type(student.inner).__name__} (in the engine)"
    got, want = run(sampling_filter=student), run()
    if student.first_difference:
        raise AssignmentError(f"{who} broke a RULE: {student.first_difference}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            sp = params[i]
            raise AssignmentError(f"{who} broke a RULE: {PURE_RULE}.\n  every call returned what TopKTopPMinP "
                                  f"returns on the same input, yet with the same seed request {i} (temperature "
                                  f"{sp.temperature}, top_k {sp.top_k}, top_p {sp.top_p}, min_p {sp.min_p}) drew "
                                  f"{g}, the default {w}")
