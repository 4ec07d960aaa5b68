"""The promotion gate's error rates at the default settings, by simulation on the gate's own functions
(``flows.lineages.evaluation.gate`` and ``compare``, which call ``rlworkers.algorithms.comparison``; no servers, no
models).

Each trial draws per-example scores of two models on the same ``--n`` examples and asks the gate:

- **0/1 scores** (greedy exact match): each example is independently a win for the candidate with probability
  ``(q + d) / 2``, a loss with ``(q - d) / 2`` and a tie otherwise (right for both 3 times in 4), ``q`` the
  discordant share (``--discordant``, 13% by default: two checkpoints of one lineage on the 200 held-out sums) and
  ``d`` the true accuracy difference. Next to the simulated rate, the exact power of the gate's sign test
  (``sign_test_power``, McNemar's test here) for the same model.
- **fractional scores** (``decoding: sampled``, ``samples: 8``, ``metric: mean``): each example has a chance ``p``
  of being answered right (Beta(0.2, 0.1): most examples always or never right, mean 0.67), its score the mean of 8
  draws; the candidate's chance is ``p + c (1 - p)``, a true mean difference ``d = c / 3``.

Rows: the champion equal to the candidate (a false promotion; the run started from the champion, as in a lineage,
and its training reward rose: the reward-hacking alarm's false alarms too, and how often the alarm's old rule, a raw
drop of more than ``hacking_threshold``, would have fired), the candidate better by ``d`` (the gate's power), and
the margin check against a lineage's best version (a candidate as good as the best, and one ``margin`` below it: how
often each passes). Settings: ``eval.confidence`` 0.95, ``promote_if`` better, ``margin`` 0.02,
``hacking_threshold`` 0.02 (the defaults). Each rate is a count over ``--trials`` trials, with its binomial
standard error; each gate call bootstraps 10,000 resamples (about 20 ms on the 2-core development machine), so the
default run (11 rows of 100 trials) takes about 20 s of CPU (30-40 s while other tests share the machine), and
``--trials 1000`` (the figures in docs/lineages.md) 3-5 minutes.

    .venv/bin/python bench/gate_error_rates.py [--n 200] [--discordant 0.13] [--trials 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from flows.config import EvalConfig
from flows.lineages.evaluation import EvalResults, compare, gate
from rlworkers.algorithms.comparison import detectable_difference, sign_test_power

DEFAULTS = EvalConfig()
GATE = {
    "promote_if": DEFAULTS.promote_if,
    "confidence": DEFAULTS.confidence,
    "margin": DEFAULTS.margin,
    "hacking_threshold": DEFAULTS.hacking_threshold,
}
SAMPLES, BETA = 8, (0.2, 0.1)  # the fractional model: 8 draws per example, P(right) ~ Beta(0.2, 0.1)


def results(scores, label: str = "final") -> EvalResults:
    rows = [{"index": i, "score": float(s)} for i, s in enumerate(scores)]
    return EvalResults("heldout", label, "f" * 16, "model", rows)


def binary_pair(rng, n: int, discordant: float, difference: float):
    """0/1 scores (candidate, baseline): win, loss, or a tie (right for both with probability 3/4)."""
    win, loss = (discordant + difference) / 2, (discordant - difference) / 2
    right = (1 - discordant) * 0.75
    kind = rng.choice(4, size=n, p=[win, loss, right, 1 - discordant - right])
    return np.isin(kind, (0, 2)).astype(float), np.isin(kind, (1, 2)).astype(float)


def sampled_pair(rng, n: int, difference: float):
    """Sampled-mean scores (candidate, baseline): 8 draws per example at the example's chance of being right."""
    p = rng.beta(*BETA, size=n)
    shift = difference / (1 - BETA[0] / sum(BETA))  # p + c (1 - p) raises the mean by c (1 - E[p])
    better = p + shift * (1 - p)
    return rng.binomial(SAMPLES, better) / SAMPLES, rng.binomial(SAMPLES, p) / SAMPLES


def rate(count: int, trials: int) -> str:
    share = count / trials
    return f"{share:6.1%} ± {math.sqrt(max(share * (1 - share), 1 / trials) / trials):.1%} ({count}/{trials})"


def equal_quality(rng, trials: int, draw) -> tuple[int, int, int, float]:
    """Promotions, reward-hacking alarms and raw drops over ``hacking_threshold`` of an unchanged model whose
    training reward rose, gated against the champion it started from; and the mean discordant share."""
    promoted = alarms = drops = 0
    discordant = 0.0
    for _ in range(trials):
        candidate, start = draw(rng)
        start_results = results(start, "start")
        decision = gate(
            results(candidate),
            start=start_results,
            champion=("champion v1", start_results),
            best=None,
            reward_change=0.1,
            **GATE,
        )
        promoted += decision.promote
        alarms += decision.hacking is not None
        drops += start.mean() - candidate.mean() > GATE["hacking_threshold"]
        discordant += decision.comparisons[0].discordant / trials
    return promoted, alarms, drops, discordant


def promotions(rng, trials: int, draw) -> int:
    promoted = 0
    for _ in range(trials):
        candidate, champion = draw(rng)
        decision = gate(
            results(candidate), start=None, champion=("champion v1", results(champion)), best=None, reward_change=None,
            **GATE,
        )  # fmt: skip
        promoted += decision.promote
    return promoted


def passes_best_check(rng, trials: int, draw) -> int:
    """How often the candidate passes the margin check against the lineage's best (the gate's compare, whose
    verdict must be better or non-inferior)."""
    kwargs = {"confidence": GATE["confidence"], "margin": GATE["margin"]}
    passed = 0
    for _ in range(trials):
        candidate, best = draw(rng)
        verdict = compare(results(candidate), results(best), "the lineage's best", **kwargs).verdict
        passed += verdict in ("better", "non-inferior")
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="examples in the eval set")
    parser.add_argument(
        "--discordant", type=float, default=0.13, help="0/1 scores: share of examples answered differently"
    )
    parser.add_argument("--trials", type=int, default=100, help="trials per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n, q, trials = args.n, args.discordant, args.trials
    rng = np.random.default_rng(args.seed)
    began = time.perf_counter()
    settings = ", ".join(f"{k} {v}" for k, v in GATE.items())
    print(f"The promotion gate at {settings}; n={n}; simulated on flows.lineages.evaluation.gate\n")

    note = detectable_difference(n, q, confidence=GATE["confidence"])
    print(f"0/1 scores, {q:.0%} of examples answered differently (the power note: {note:.3f} found with 80% power)\n")
    print("| true difference | promoted (simulated gate) | its sign test alone, exact (a bound) |")
    print("|---|---|---|")
    promoted, alarms, drops, _ = equal_quality(rng, trials, lambda r: binary_pair(r, n, q, 0.0))
    print(f"| 0 (a false promotion) | {rate(promoted, trials)} | {sign_test_power(n, q, 0.0):.1%} |")
    for difference in (0.03, 0.05, round(note, 3), 0.10):
        count = promotions(rng, trials, lambda r, d=difference: binary_pair(r, n, q, d))
        print(f"| +{difference:.3f} | {rate(count, trials)} | {sign_test_power(n, q, difference):.1%} |")
    print(
        f"\nreward-hacking alarm, unchanged model, training reward up: {rate(alarms, trials)} "
        f"(the old rule, a raw drop > {GATE['hacking_threshold']:g}: {rate(drops, trials)})"
    )
    margin = GATE["margin"]
    equal = passes_best_check(rng, trials, lambda r: binary_pair(r, n, q, 0.0))
    below = passes_best_check(rng, trials, lambda r: binary_pair(r, n, q, -margin))
    print(f"margin check against the best, passed by a candidate as good as the best: {rate(equal, trials)}")
    print(f"margin check against the best, passed by a candidate {margin:g} below the best: {rate(below, trials)}")

    promoted, alarms, drops, discordant = equal_quality(rng, trials, lambda r: sampled_pair(r, n, 0.0))
    print(
        f"\nfractional scores: the mean of {SAMPLES} sampled answers, P(right) ~ Beta{BETA} "
        f"({discordant:.0%} of examples scored differently at equal quality)\n"
    )
    print("| true difference | promoted (simulated gate) |")
    print("|---|---|")
    print(f"| 0 (a false promotion) | {rate(promoted, trials)} |")
    for difference in (0.01, 0.02, 0.03):
        count = promotions(rng, trials, lambda r, d=difference: sampled_pair(r, n, d))
        print(f"| +{difference:.3f} | {rate(count, trials)} |")
    print(
        f"\nreward-hacking alarm, unchanged model, training reward up: {rate(alarms, trials)} "
        f"(the old rule: {rate(drops, trials)})"
    )
    print(f"\n{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
