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
parameters. Then the engine runs the filter: seeded sampling must give the tokens the default gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.layers.sampler import CheckedFilter, SamplingFilter, SamplingRow, SamplingTensors, TopKTopPMinP
from minivllm.teaching.hands_on import AssignmentError, check_finished, tiny_model

# Probabilities of a float32 softmax over V = 64 logits: rounding stays < 64 * 1.2e-7 relative; 1e-5 is far
# above that and far below any mistake (a token wrongly kept or dropped moves others by >= 1e-3 here).
PROB_ATOL = 1e-5
VOCAB = 64


@dataclass(frozen=True)
class FilterProbe:
    """Rows of random logits, each with (top_k, top_p, min_p); the rule a failure names."""

    name: str
    rule: str
    rows: tuple[tuple[int, float, float], ...]


FILTER_PROBES = (
    FilterProbe("off", "a row that asks for nothing (top_k 0 or V, top_p 1, min_p 0) keeps every token, with the "
                "model's probabilities", ((0, 1.0, 0.0), (VOCAB, 1.0, 0.0))),
    FilterProbe("top-k", "top-k keeps the k most likely tokens (and any tied with the k-th), removing the rest",
                ((1, 1.0, 0.0), (5, 1.0, 0.0), (40, 1.0, 0.0))),
    FilterProbe("top-p", "top-p keeps the most likely tokens until their probability mass reaches top_p, the "
                "token that crosses it included (so the top token is always kept)",
                ((0, 0.5, 0.0), (0, 0.9, 0.0), (0, 0.05, 0.0))),
    FilterProbe("min-p", "min-p keeps the tokens whose probability is at least min_p times the top token's",
                ((0, 1.0, 0.1), (0, 1.0, 0.5), (0, 1.0, 0.01))),
    FilterProbe("in order", "the three run in order, each on what the one before kept: top-p measures the mass "
                "of the tokens top-k kept, renormalised (and min-p compares with the top token of what is left)",
                ((10, 0.8, 0.0), (20, 0.6, 0.1), (5, 0.95, 0.2))),
    FilterProbe("per row", "each row uses its own parameters, whatever the other rows of the batch ask",
                ((3, 1.0, 0.0), (0, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05), (1, 0.5, 0.5))),
)
KEEP_RULE = "every row the sampler draws from keeps at least one token, and the shape stays (rows, vocabulary)"
DIST_RULE = ("a kept token keeps its probability relative to the other kept ones: return logits (or "
             "log-probabilities) with removed tokens at -inf, not probabilities or rescaled logits")


def tensors_for(rows: tuple[tuple[int, float, float], ...], temperature: float = 1.0) -> SamplingTensors:
    params = [SamplingRow(temperature, k, p, m, seed=i, position=0) for i, (k, p, m) in enumerate(rows)]
    return SamplingTensors.from_params(params, VOCAB, torch.device("cpu"))


def random_logits(num_rows: int, seed: int, tie: bool = False) -> torch.Tensor:
    """(R, V) logits spread like a small model's; `tie`: tokens 3 and 7 equal in every row (top-k's edge case.
    Not for top-p: which of two tied tokens a sort ranks first is the sort's choice, not a rule)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=g) * 2.5  # (R, V)
    if tie:
        logits[:, 7] = logits[:, 3]
    return logits


def _compare(who: str, name: str, rule: str, got: torch.Tensor, want: torch.Tensor, rows: tuple) -> None:
    kept, want_kept = got > float("-inf"), want > float("-inf")  # (R, V) each
    for r in range(len(rows)):
        k, p, m = rows[r]
        where = f"probe '{name}', row {r} (top_k={k}, top_p={p}, min_p={m})"
        if not torch.equal(kept[r], want_kept[r]):
            extra = (kept[r] & ~want_kept[r]).nonzero()[:, 0].tolist()
            missing = (want_kept[r] & ~kept[r]).nonzero()[:, 0].tolist()
            raise AssignmentError(f"{who} broke a RULE: {rule}.\n  {where}: kept {int(kept[r].sum())} tokens, "
                                  f"expected {int(want_kept[r].sum())}; kept but should not: {extra[:8]}, removed "
                                  f"but should not: {missing[:8]}")
        diff = float((got[r].softmax(-1) - want[r].softmax(-1)).abs().nan_to_num(1.0).max())
        if diff > PROB_ATOL:
            raise AssignmentError(f"{who} broke a RULE: {DIST_RULE}.\n  {where}: the right tokens are kept, but a "
                                  f"probability differs by {diff:.3g} from the model's renormalised one")


def check_filter_probes(make_filter: Callable[[], SamplingFilter], seed: int = 0) -> None:
    """Each probe through the student's filter (wrapped in the engine's `CheckedFilter`), then 100 random
    mixes, against the engine's `TopKTopPMinP`; raise `AssignmentError` naming the first rule broken."""
    checked, reference = CheckedFilter(make_filter()), TopKTopPMinP()
    who = type(checked.inner).__name__
    rng = torch.Generator().manual_seed(seed)
    probes = list(FILTER_PROBES)
    for i in range(100):  # random mixes: any k, p and m, several rows at once
        u = torch.rand(4, 2, generator=rng).tolist()  # top_p in [0.05, 1] (SamplingParams refuses 0), min_p in [0, 0.3]
        rows = tuple((int(torch.randint(0, VOCAB + 1, (), generator=rng)), round(0.05 + 0.95 * a, 2), round(0.3 * b, 2))
                     for a, b in u)
        probes.append(FilterProbe(f"random mix {i}", "the same tokens and probabilities as the engine's TopKTopPMinP",
                                  rows))
    for n, probe in enumerate(probes):
        logits, t = random_logits(len(probe.rows), seed + n, tie=probe.name == "top-k"), tensors_for(probe.rows)
        try:
            got = checked(logits.clone(), t)
        except AssertionError as error:  # FilterContractError: the seam's own rules
            raise AssignmentError(f"{who} broke a RULE: {KEEP_RULE}.\n  probe '{probe.name}' {probe.rows}, which "
                                  f"checks that {probe.rule}: {error}") from None
        except NotImplementedError:
            raise
        except Exception as error:  # a crash on this probe's rows: named by the probe's rule
            raise AssignmentError(f"{who} broke a RULE: {probe.rule}.\n  probe '{probe.name}' {probe.rows}: your code "
                                  f"raised {type(error).__name__}: {error}") from error
        _compare(who, probe.name, probe.rule, got.float(), reference(logits.clone(), t), probe.rows)


def check_filter_in_engine(make_filter: Callable[[], SamplingFilter], max_tokens: int = 8) -> None:
    """LLM(sampling_filter=...) on a tiny random model: seeded sampling with top-k, top-p and min-p (and a greedy
    row among them) gives exactly the default engine's tokens."""
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

    student = make_filter()
    who = f"{type(student).__name__} (in the engine)"
    got, want = run(sampling_filter=student), run()
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            sp = params[i]
            raise AssignmentError(f"{who} broke a RULE: with the same seed, the "
                                  f"engine draws the same tokens as with its own filter; request {i} (temperature "
                                  f"{sp.temperature}, top_k {sp.top_k}, top_p {sp.top_p}, min_p {sp.min_p}) drew "
                                  f"{g}, the default {w}")
