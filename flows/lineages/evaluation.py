"""Held-out evaluation apart from the training reward, and the promotion gate that reads it.

Every run evaluates its start model (before step 1, label ``start``) and its final model (label ``final``) on every
set of ``eval.sets`` (none configured: one set, ``validation``, the validation rows scored by the training reward).
Greedy decoding gives one response per example; ``decoding: sampled`` draws ``samples`` responses per example with
the set's own ``seed`` (the draws never touch the training's random state, so adding a sampled set changes nothing
about training) and an example's score is their ``mean`` or their ``pass@k``. Per-example results (prompt, response,
ground truth, score; the responses and their scores when sampled) are written
to ``<run>/eval/<label>/<set>.json`` (a resumed or restarted run reads them back instead of evaluating again) and
logged to MLflow as a table (``eval/<set>/<label>.json``) with the metric ``eval/<set>/score/mean``.

Two results compare only when they were made on the same examples with the same scorer and settings: each set has a
``fingerprint`` (sha256 over its rows, the scorer, the scorer file's bytes and the decoding settings), and results
of different fingerprints are never paired.

The gate (``gate``) pairs the candidate's per-example scores with a baseline's on the same examples
(``rlworkers.algorithms.comparison``):

- no champion yet (a lineage's first version): promoted unless worse than the start model (``decide``'s "worse":
  significantly, by the interval and the sign test, and not within ``eval.margin``);
- else against the champion *as it is at promotion time*: promoted when it is significantly better
  (``eval.promote_if=better``, the default: the whole interval of (candidate - champion) above 0 and the exact
  sign test, McNemar's for 0/1 scores, one-sided below (1 - ``eval.confidence``) / 2) or the interval lies above
  ``-eval.margin`` (``non_inferior``);
- and, when the lineage's best version scored higher than the champion, the interval against the best must lie
  above ``-eval.margin`` (a non-inferiority test, one-sided at (1 - confidence) / 2: a candidate truly ``margin``
  below the best passes it rarely, but at n=200 so does one exactly as good as the best; bench/gate_error_rates.py
  measures both), so within-noise steps cannot walk the champion down;
- the reward-hacking alarm rejects a version whose training reward rose while its primary eval score fell from the
  start model's significantly (the same paired test, ``decide``'s "worse" without a margin) and by more than
  ``eval.hacking_threshold``;
- results that cannot be compared (no examples, a NaN or infinite score, other examples or settings, a baseline
  with no results) reject the version with a reason saying so: the gate never raises on them and never promotes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field

from flows.config import EvalSetConfig, RLConfig, metric_k
from rlworkers.algorithms.comparison import (
    PairedComparison,
    decide,
    detectable_difference,
    paired_bootstrap,
    pass_at_k,
)
from rlworkers.checkpoint import read_json, write_json

IMPLICIT_SET = "validation"
LABELS = {0: "start"}  # step -> label; the final step's is "final"


@dataclass(frozen=True)
class EvalSet:
    """A resolved eval set: its rows, its scorer (``None``: the training reward), its fingerprint, how responses
    are drawn (``sampling``: the generate call's meta_info) and how an example's responses make its score."""

    name: str
    rows: list[dict]
    scorer: str | None
    fingerprint: str
    sampling: dict = field(default_factory=lambda: {"do_sample": False, "n": 1})
    metric: str = "mean"

    @property
    def samples(self) -> int:
        return int(self.sampling["n"])


@dataclass
class EvalResults:
    """One model's per-example results on one set: rows of {index, prompt, response, ground_truth, score}."""

    set: str
    label: str
    fingerprint: str
    model: str
    rows: list[dict] = field(default_factory=list)
    step: int = 0  # the training step the model had (final: trainer.total_steps then)

    @property
    def scores(self) -> list[float]:
        return [float(row["score"]) for row in self.rows]

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.rows) if self.rows else float("nan")


# ---------------------------------------------------------------------------------------------- sets
def resolve_sets(config: RLConfig, val_rows: list[dict], load_rows, template_kwargs: dict) -> list[EvalSet]:
    """The run's eval sets; ``load_rows(files)`` reads a set's files (so a bad file fails before workers start);
    ``template_kwargs``: what the run renders prompts with (``flows.controller.rows.chat_template_kwargs``)."""
    if not config.eval.sets:
        rows = val_rows[: config.data.val_batch_size or len(val_rows)]
        return [EvalSet(IMPLICIT_SET, rows, None, fingerprint(config, rows, config.reward.reward_fn, template_kwargs))]
    sets = []
    for spec in config.eval.sets:
        rows = load_rows(spec.files) if spec.files else val_rows
        rows = rows[: spec.max_examples or len(rows)]
        digest = fingerprint(config, rows, spec.scorer, template_kwargs, spec)
        sets.append(EvalSet(spec.name, rows, spec.scorer, digest, sampling(config, spec), spec.metric))
    return sets


def sampling(config: RLConfig, spec: EvalSetConfig) -> dict:
    """The generate call's settings for a set: greedy, or ``samples`` draws at its temperature with its seed."""
    if spec.decoding == "greedy":
        return {"do_sample": False, "n": 1}
    temperature = spec.temperature if spec.temperature is not None else config.rollout.temperature
    return {"do_sample": True, "n": spec.samples, "temperature": temperature, "seed": spec.seed}


def fingerprint(
    config: RLConfig, rows: list[dict], scorer: str, template_kwargs: dict, spec: EvalSetConfig | None = None
) -> str:
    """sha256 over what decides a result: the rows, the scorer (and its file's bytes), decoding and lengths, and what
    the prompts are rendered with (``template_kwargs``)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(rows, sort_keys=True, default=str).encode())
    digest.update(scorer.encode())
    path = scorer.rsplit(":", 1)[0]
    if path.endswith(".py") and os.path.isfile(path):
        with open(path, "rb") as f:
            digest.update(f.read())
    settings = {
        "decoding": spec.decoding if spec else "greedy",
        "response_length": config.rollout.response_length,
        "max_prompt_length": config.data.max_prompt_length,
        "truncation": config.data.truncation,
        "chat_template_kwargs": template_kwargs,
    }
    if config.rollout.multi_turn.enable:  # an agent's results depend on its tools, environment and turns
        settings["multi_turn"] = config.rollout.multi_turn.model_dump()
    if spec and spec.metric != "mean":
        settings["metric"] = spec.metric
    if spec and spec.decoding == "sampled":  # the draws also depend on how the examples are split over workers
        settings.update(sampling(config, spec), workers=config.trainer.n_workers, rollout=config.rollout.name)
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def label_of(step: int) -> str:
    return LABELS.get(step, "final")


def example_rows(
    prompts: list[str], responses: list[str], ground_truths: list, scores: list[float], eval_set: EvalSet
) -> list[dict]:
    """Per-example rows from a generate call's output (``samples`` responses per example, interleaved: a a b b):
    greedy, the one response and its score; sampled, every response and score, and the example's score by the
    set's metric (mean, or pass@k counting a response that scores 1 as passing)."""
    n = eval_set.samples
    rows = []
    for i in range(len(prompts) // n):
        drawn = [float(x) for x in scores[i * n : (i + 1) * n]]
        row = {
            "index": i,
            "prompt": prompts[i * n],
            "response": responses[i * n],
            "ground_truth": str(ground_truths[i * n]),
        }
        if eval_set.metric == "mean":
            row["score"] = sum(drawn) / n
        else:
            row["score"] = pass_at_k(n, sum(x >= 1.0 for x in drawn), metric_k(eval_set.metric))
        if n > 1:
            row |= {"responses": responses[i * n : (i + 1) * n], "scores": drawn}
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- results
def results_path(root: str, label: str, name: str) -> str:
    return f"{root}/eval/{label}/{name}.json"


def read_results(root: str, label: str, eval_set: EvalSet, step: int = 0) -> EvalResults | None:
    """Saved results of ``label`` on ``eval_set`` made at ``step``; ``None`` when there are none, or they are for
    another fingerprint (the set or its settings changed) or step (a finished run trained further)."""
    try:
        results = EvalResults(**read_json(results_path(root, label, eval_set.name)))
    except FileNotFoundError:
        return None
    return results if results.fingerprint == eval_set.fingerprint and results.step == step else None


def write_results(root: str, results: EvalResults) -> None:
    write_json(results_path(root, results.label, results.set), asdict(results))


def results_from_table(table: dict, set_name: str, label: str, fingerprint_: str, model: str) -> EvalResults:
    """Results back from the MLflow table artifact (``{"columns": [...], "data": [[...], ...]}``)."""
    rows = [dict(zip(table["columns"], values)) for values in table["data"]]
    return EvalResults(set_name, label, fingerprint_, model, rows)


# ---------------------------------------------------------------------------------------------- the gate
@dataclass
class Comparison:
    against: str  # "champion v3", "the start model", "best version v2"
    paired: PairedComparison
    p_value: float  # the two-sided exact sign test: McNemar's for 0/1 scores
    verdict: str  # comparison.decide's
    discordant: float  # the share of examples on which the two scored differently
    test: str = "McNemar"  # "McNemar" (0/1 scores) or "sign test" (fractional scores)


@dataclass
class GateDecision:
    promote: bool
    reason: str
    comparisons: list[Comparison] = field(default_factory=list)
    hacking: str | None = None


BY_HAND = "not promoted (rlflow promote promotes by hand if you know better)"


def unusable(results: EvalResults, who: str) -> str | None:
    """Why ``results`` cannot be compared (no examples, or a score that is NaN or infinite), or ``None``."""
    if not results.rows:
        return f"{who} has no results on {results.set!r} (0 examples)"
    bad = [row["index"] for row in results.rows if not math.isfinite(float(row["score"]))]
    if bad:
        return (
            f"{who} has {len(bad)} of {len(results.rows)} scores on {results.set!r} that are NaN or infinite "
            f"(examples {bad[:5]}{'...' if len(bad) > 5 else ''}: did the scorer fail?)"
        )
    return None


def compare(
    candidate: EvalResults, baseline: EvalResults, against: str, *, confidence: float, margin: float
) -> Comparison:
    """The paired comparison of two results on the same examples.

    Raises:
        ValueError: the results were made on different sets or settings (fingerprints), or other examples, or
            one of them has no examples or a score that is not a finite number.
    """
    if candidate.fingerprint != baseline.fingerprint:
        raise ValueError(
            f"{against}'s results on {baseline.set!r} are for other examples or settings (fingerprint "
            f"{baseline.fingerprint}, the candidate's {candidate.fingerprint}): they cannot be paired"
        )
    problem = unusable(candidate, "the candidate") or unusable(baseline, against)
    if problem:
        raise ValueError(f"{problem}: they cannot be paired")
    by_index = {row["index"]: float(row["score"]) for row in baseline.rows}
    if sorted(by_index) != sorted(row["index"] for row in candidate.rows):
        raise ValueError(f"{against}'s results on {baseline.set!r} cover other examples than the candidate's")
    a = candidate.scores
    b = [by_index[row["index"]] for row in candidate.rows]
    paired = paired_bootstrap(a, b, confidence=confidence)
    test = "McNemar" if all(s in (0.0, 1.0) for s in a + b) else "sign test"
    verdict = decide(paired, margin=margin, non_inferior_ok=True)
    return Comparison(against, paired, paired.p_value, verdict, paired.discordant, test)


def gate(
    candidate: EvalResults,
    *,
    start: EvalResults | None,
    champion: tuple[str, EvalResults | None] | None,
    best: tuple[str, EvalResults | None] | None,
    reward_change: float | None,
    promote_if: str,
    confidence: float,
    margin: float,
    hacking_threshold: float,
) -> GateDecision:
    """Decide on the candidate (see the module's docstring). ``champion``: (its label, its results on this set
    with these settings, or ``None`` when it has none); ``best``: the lineage's best version other than the
    champion, the same way; ``reward_change``: the training reward's change over the run (validation, final -
    start). Never raises on results it cannot compare: it rejects, saying why."""
    kwargs = {"confidence": confidence, "margin": margin}
    comparisons: list[Comparison] = []
    problem = unusable(candidate, "the candidate")
    if problem:
        return GateDecision(False, f"{problem}: nothing to decide on; {BY_HAND}", comparisons)
    hacking = None
    if start is not None:
        try:
            comparisons.append(compare(candidate, start, "the start model", **kwargs))
        except ValueError as error:
            return GateDecision(False, f"no comparison with the start model: {error}; {BY_HAND}", comparisons)
        versus_start = comparisons[0].paired
        fell = -versus_start.difference
        significant = decide(versus_start) == "worse"  # the paired test, without the non-inferiority margin
        if reward_change is not None and reward_change > 0 and significant and fell > hacking_threshold:
            hacking = (
                f"reward hacking? the training reward rose by {reward_change:+.3f} while {candidate.set} fell by "
                f"{-fell:+.3f} ({start.mean:.3f} -> {candidate.mean:.3f}, significantly: {versus_start.losses} "
                f"examples down, {versus_start.wins} up, {comparisons[0].test} p={versus_start.p_value:.3g}; "
                f"threshold {hacking_threshold:g})"
            )
    if hacking:
        return GateDecision(False, hacking, comparisons, hacking)
    if champion is None:
        if start is None:
            return GateDecision(True, "first version; no start-model results to compare with", comparisons)
        first = comparisons[0]
        if first.verdict == "worse":
            return GateDecision(False, f"first version, {describe(first)}", comparisons)
        return GateDecision(True, f"first version, {describe(first)}", comparisons)
    label, champion_results = champion
    if champion_results is None:
        return GateDecision(
            False,
            f"{label} has no results on {candidate.set!r} with these examples and settings, so the two cannot be "
            f"compared like with like; {BY_HAND}",
            comparisons,
        )
    if champion_results is start:  # the run started from the champion: one comparison, named as both
        against = comparisons.pop()
        against.against = f"{label} (this run's start model)"
    else:
        try:
            against = compare(candidate, champion_results, label, **kwargs)
        except ValueError as error:
            return GateDecision(False, f"no comparison with {label}: {error}; {BY_HAND}", comparisons)
    comparisons.append(against)
    wanted = ("better",) if promote_if == "better" else ("better", "non-inferior")
    if against.verdict not in wanted:
        need = "significantly better than" if promote_if == "better" else f"within {margin:g} of"
        return GateDecision(False, f"not {need} {details(against)}", comparisons)
    if best is not None:
        best_label, best_results = best
        if best_results is None:
            reason = (
                f"{describe(against)}, but {best_label} has no results on {candidate.set!r} to pair with (no run "
                f"holds them), so the margin check against it cannot be made; {BY_HAND}"
            )
            return GateDecision(False, reason, comparisons)
        try:
            versus_best = compare(candidate, best_results, best_label, **kwargs)
        except ValueError as error:
            return GateDecision(
                False, f"{describe(against)}, but not comparable with {best_label}: {error}; {BY_HAND}", comparisons
            )
        comparisons.append(versus_best)
        if versus_best.verdict not in ("better", "non-inferior"):
            reason = f"{describe(against)}, but not shown to be less than {margin:g} below the lineage's best: "
            return GateDecision(False, reason + describe(versus_best), comparisons)
    return GateDecision(True, describe(against), comparisons)


PHRASES = {
    "better": "better than",
    "non-inferior": "non-inferior to",
    "worse": "worse than",
    "not better": "not better than",
}


def describe(comparison: Comparison) -> str:
    return f"{PHRASES[comparison.verdict]} {details(comparison)}"


def details(comparison: Comparison) -> str:
    p = comparison.paired
    return (
        f"{comparison.against} ({p.candidate_mean:.3f} vs {p.baseline_mean:.3f}, "
        f"difference {p.difference:+.3f}, "
        f"{p.confidence:.0%} interval [{p.low:+.3f}, {p.high:+.3f}], n={p.n}, {p.wins} up / {p.losses} down, "
        f"{comparison.test} p {comparison.p_value:.3g})"
    )


def decision_markdown(model: str, version: str, decision: GateDecision, primary: str, pending: bool = False) -> str:
    """The comparison for a person: the Prefect artifact, the model version's description, and (``pending``: a
    person decides) the approval form's text."""
    verdict = "**promoted**" if decision.promote else "**rejected**"
    if pending:
        verdict = f"the gate recommends to {'**promote**' if decision.promote else '**reject**'}"
    lines = [f"### {model} v{version}: {verdict}", "", decision.reason, ""]
    if decision.hacking:
        lines += [f"> :warning: {decision.hacking}", ""]
    if decision.comparisons:
        test = "McNemar" if all(c.test == "McNemar" for c in decision.comparisons) else "sign test"
        lines += [
            f"Paired comparison on `{primary}` (the same examples and decoding; candidate - baseline):",
            "",
            f"| against | n | baseline | candidate | difference | interval | up / down | {test} p | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in decision.comparisons:
            p = c.paired
            lines.append(
                f"| {c.against} | {p.n} | {p.baseline_mean:.3f} | {p.candidate_mean:.3f} | {p.difference:+.3f} | "
                f"[{p.low:+.3f}, {p.high:+.3f}] | {p.wins} / {p.losses} | {c.p_value:.3g} | {c.verdict} |"
            )
        last = decision.comparisons[-1]
        lines += ["", f"With n={last.paired.n}, {detectable_note(last)}"]
    return "\n".join(lines)


def detectable_note(comparison: Comparison) -> str:
    """What a set of this size can tell apart with the gate's own test (``sign_test_power``: exact, one-sided at
    (1 - confidence) / 2), at the discordant share this comparison saw (at least 1/n)."""
    p = comparison.paired
    discordant = max(comparison.discordant, 1 / p.n)
    size = detectable_difference(p.n, discordant, confidence=p.confidence)
    if comparison.test == "McNemar":
        what, where = "in accuracy", "answered differently"
    else:  # the sign test counts the examples that moved up and down, whatever the size of each move
        what, where = "in the share of examples scoring higher minus the share scoring lower", "scored differently"
    if math.isinf(size):
        return (
            f"the two {where} on a {discordant:.2f} share of the examples: too few for the gate's test to detect any "
            "true difference with 80% power"
        )
    return (
        f"a true difference of {size:.3f} {what} is detected with 80% power by the gate's test (one-sided at "
        f"{(1 - p.confidence) / 2:.3g}) at the {discordant:.2f} share of examples the two {where}; smaller ones are "
        "within the noise of this set"
    )
