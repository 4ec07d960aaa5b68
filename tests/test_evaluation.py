"""The promotion gate's logic (flows/lineages/evaluation.py) on per-example results built here: it does not promote on
noise, promotes a clear improvement, rejects reward hacking, never walks down from the lineage's best, and never
pairs results made on other examples or settings; what its comparison table says it can detect is what a simulation
of the gate detects; results it cannot compare (no examples, NaN) get a decision, never an exception. The gate
against real servers and training: tests/test_promotion.py. Its error rates at the default settings:
bench/gate_error_rates.py.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from flows.config import ConfigError, load_config
from flows.controller.rows import chat_template_kwargs
from flows.lineages.evaluation import (
    EvalResults,
    EvalSet,
    compare,
    decision_markdown,
    detectable_note,
    example_rows,
    gate,
    resolve_sets,
    results_from_table,
)
from flows.lineages.versions import version_results

GATE = {"promote_if": "better", "confidence": 0.95, "margin": 0.02, "hacking_threshold": 0.02}


def results(scores, label="final", fingerprint="f" * 16) -> EvalResults:
    rows = [
        {"index": i, "prompt": f"p{i}", "response": "r", "ground_truth": "g", "score": float(s)}
        for i, s in enumerate(scores)
    ]
    return EvalResults("heldout", label, fingerprint, "model", rows)


def two_models(rng, n: int, p_baseline: float, p_candidate: float):
    """0/1 results of two models on the same n examples: each example has a difficulty both models share (so most
    examples are right for both or wrong for both, as with two checkpoints of one lineage)."""
    difficulty = rng.random(n)
    noise = rng.random(n) * 0.3
    baseline = (difficulty + noise * rng.random(n) < p_baseline + 0.15).astype(float)
    candidate = (difficulty + noise * rng.random(n) < p_candidate + 0.15).astype(float)
    return candidate, baseline


def discordant_pairs(rng, n: int, discordant: float, difference: float, accuracy: float = 0.75):
    """0/1 results of two models on the same n examples, each example independently a win for the candidate
    (probability (discordant + difference) / 2), a loss ((discordant - difference) / 2), or a tie, right for both
    with probability ``accuracy``: the model behind comparison.sign_test_power."""
    win, loss = (discordant + difference) / 2, (discordant - difference) / 2
    tie_right = (1 - discordant) * accuracy
    kind = rng.choice(4, size=n, p=[win, loss, tie_right, 1 - discordant - tie_right])
    return np.isin(kind, (0, 2)).astype(float), np.isin(kind, (1, 2)).astype(float)


def test_equal_quality_is_not_promoted_on_noise():
    rng = np.random.default_rng(0)
    promoted, means_differ = 0, 0
    for _ in range(200):
        candidate, champion = two_models(rng, 200, 0.7, 0.7)
        means_differ += candidate.mean() != champion.mean()
        decision = gate(
            results(candidate),
            start=None,
            champion=("champion v1", results(champion)),
            best=None,
            reward_change=None,
            **GATE,
        )
        promoted += decision.promote
    assert means_differ > 150  # the means differ almost always: a gate on the means would move on noise
    assert promoted <= 10, f"{promoted} of 200 equal-quality candidates promoted (a 95% interval allows ~5)"


def test_a_few_flipped_answers_are_not_an_improvement():
    """4 of 200 answers flipped to right, none to wrong: the percentile bootstrap's interval alone excludes 0, but
    McNemar's exact p is 0.125: not promoted."""
    champion = [1.0] * 150 + [0.0] * 50
    candidate = [1.0] * 154 + [0.0] * 46
    decision = gate(results(candidate), start=None, champion=("champion v1", results(champion)), best=None,
                    reward_change=None, **GATE)  # fmt: skip
    comparison = decision.comparisons[-1]
    assert comparison.paired.low > 0 and comparison.p_value == 0.125
    assert not decision.promote and comparison.verdict == "non-inferior"


def test_a_clear_improvement_is_promoted():
    rng = np.random.default_rng(1)
    promoted = 0
    for _ in range(50):
        candidate, champion = two_models(rng, 200, 0.6, 0.8)
        decision = gate(
            results(candidate),
            start=None,
            champion=("champion v1", results(champion)),
            best=None,
            reward_change=0.1,
            **GATE,
        )
        promoted += decision.promote
        assert decision.comparisons[-1].p_value is not None  # 0/1 scores: McNemar's test is reported too
    assert promoted >= 45


def test_reward_hacking_is_rejected_with_the_alarm():
    start = results([1] * 80 + [0] * 20, label="start")
    candidate = results([1] * 60 + [0] * 40)
    decision = gate(candidate, start=start, champion=None, best=None, reward_change=0.4, **GATE)
    assert not decision.promote and decision.hacking and decision.reason == decision.hacking
    assert "training reward rose by +0.400" in decision.hacking and "0.800 -> 0.600" in decision.hacking
    # the same drop with a falling training reward is no alarm (and a first version worse than its start: rejected)
    plain = gate(candidate, start=start, champion=None, best=None, reward_change=-0.1, **GATE)
    assert plain.hacking is None and not plain.promote and "worse than the start model" in plain.reason


def test_a_first_version_is_promoted_unless_worse_than_its_start_model():
    start = results([1] * 50 + [0] * 50, label="start")
    same = gate(results([1] * 49 + [0] * 51), start=start, champion=None, best=None, reward_change=0.0, **GATE)
    assert same.promote and same.reason.startswith("first version, not better than the start model")


def test_within_noise_steps_cannot_walk_the_champion_down_from_the_best():
    """non_inferior mode: each candidate is within the margin of the champion, but the chain has drifted more
    than the margin below the lineage's best version: rejected."""
    best = results([1] * 920 + [0] * 80)
    champion = results([1] * 895 + [0] * 105)
    candidate = results([1] * 870 + [0] * 130)
    kwargs = {**GATE, "promote_if": "non_inferior", "margin": 0.04}
    alone = gate(candidate, start=None, champion=("champion v3", champion), best=None, reward_change=0.0, **kwargs)
    assert alone.promote  # within 0.04 of the champion
    with_best = gate(
        candidate,
        start=None,
        champion=("champion v3", champion),
        best=("the lineage's best, v1", best),
        reward_change=0.0,
        **kwargs,
    )
    assert not with_best.promote and "below the lineage's best" in with_best.reason


def test_results_of_other_examples_or_settings_are_never_paired():
    candidate = results([1, 0, 1, 1])
    other = results([1, 1, 1, 1], fingerprint="0" * 16)
    with pytest.raises(ValueError, match="cannot be paired"):
        compare(candidate, other, "champion v2", confidence=0.95, margin=0.0)
    decision = gate(candidate, start=None, champion=("champion v2", None), best=None, reward_change=None, **GATE)
    assert not decision.promote and "cannot be compared like with like" in decision.reason


def test_decision_markdown_names_scores_interval_and_test():
    start = results([1] * 50 + [0] * 50, label="start")
    candidate = results([1] * 80 + [0] * 20)
    decision = gate(candidate, start=None, champion=("champion v4", start), best=None, reward_change=0.2, **GATE)
    text = decision_markdown("lin", "5", decision, "heldout")
    assert decision.promote and "lin v5: **promoted**" in text
    assert "| champion v4 | 100 | 0.500 | 0.800 | +0.300 |" in text and "McNemar" in text
    assert "true difference of" in text  # what the set can detect


def test_results_read_back_from_mlflows_table_layout():
    table = {
        "columns": ["index", "prompt", "response", "ground_truth", "score"],
        "data": [[0, "1+1=", "2", "2", 1.0], [1, "2+2=", "5", "4", 0.0]],
    }
    back = results_from_table(table, "heldout", "final", "f" * 16, "models:/lin/1")
    assert back.scores == [1.0, 0.0] and back.mean == 0.5 and back.rows[1]["response"] == "5"


def test_eval_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="eval.primary 'nope' is not a set's name"):
        load_config("demo", ["eval.sets=[{name: heldout, scorer: exact}]", "eval.primary=nope"])
    with pytest.raises(ConfigError, match="trainer.promotion_tolerance was replaced"):
        load_config("demo", ["trainer.promotion_tolerance=0.1"])
    with pytest.raises(ConfigError, match="two sets share a name"):
        load_config("demo", ["eval.sets=[{name: a}, {name: a}]"])
    config = load_config("demo", ["eval.sets=[{name: heldout, scorer: exact, max_examples: 50}]"])
    assert config.eval.primary_set == "heldout" and config.eval.sets[0].decoding == "greedy"

    with pytest.raises(ConfigError, match="greedy decoding gives one deterministic response"):
        load_config("demo", ["eval.sets=[{name: heldout, samples: 4}]"])
    with pytest.raises(ConfigError, match="pass@4 needs samples >= 4"):
        load_config("demo", ["eval.sets=[{name: heldout, decoding: sampled, samples: 2, metric: pass@4}]"])
    with pytest.raises(ConfigError, match="metric"):
        load_config("demo", ["eval.sets=[{name: heldout, metric: best}]"])


def test_sampled_examples_score_by_their_mean_or_pass_at_k():
    prompts = ["a", "a", "a", "a", "b", "b", "b", "b"]  # 4 samples per example, interleaved as generate returns them
    responses = ["1", "2", "3", "4", "5", "6", "7", "8"]
    scores = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]

    def rows(metric):
        sampled = EvalSet("heldout", [], "exact", "f" * 16, {"do_sample": True, "n": 4, "seed": 0}, metric)
        return example_rows(prompts, responses, ["g1"] * 4 + ["g2"] * 4, scores, sampled)

    mean, pass_2 = rows("mean"), rows("pass@2")
    assert [r["score"] for r in mean] == [0.25, 0.0] and [r["score"] for r in pass_2] == [0.5, 0.0]
    assert mean[0]["responses"] == ["1", "2", "3", "4"] and mean[1]["scores"] == [0.0] * 4
    assert {k: mean[1][k] for k in ("index", "prompt", "response", "ground_truth", "score")} == {
        "index": 1, "prompt": "b", "response": "5", "ground_truth": "g2", "score": 0.0
    }  # fmt: skip
    greedy = example_rows(["a", "b"], ["1", "5"], ["g1", "g2"], [1.0, 0.0], EvalSet("heldout", [], "exact", "f" * 16))
    assert [r["score"] for r in greedy] == [1.0, 0.0] and "responses" not in greedy[0]


def test_every_setting_that_changes_the_draws_changes_the_fingerprint():
    def digest(*overrides, sets="[{name: heldout, scorer: exact, decoding: sampled, samples: 4}]"):
        config = load_config("demo", [f"eval.sets={sets}", *overrides])
        rows = [{"prompt": "1+1=", "answer": "2"}]
        return resolve_sets(config, rows, lambda files: rows, chat_template_kwargs(config))[0].fingerprint

    sampled = digest()
    assert sampled == digest()
    changed = [
        digest(sets="[{name: heldout, scorer: exact, decoding: sampled, samples: 4, seed: 1}]"),
        digest(sets="[{name: heldout, scorer: exact, decoding: sampled, samples: 8}]"),
        digest(sets="[{name: heldout, scorer: exact, decoding: sampled, samples: 4, metric: pass@2}]"),
        digest("rollout.temperature=0.5"),
        digest("trainer.n_workers=1"),
    ]
    assert sampled not in changed and len(set(changed)) == len(changed)
    greedy = "[{name: heldout, scorer: exact}]"
    assert digest(sets=greedy) == digest("trainer.n_workers=1", sets=greedy)  # greedy: one answer however split


def test_the_power_note_is_what_a_simulation_of_the_gate_finds():
    """The comparison table's note (n=200, 13% of examples answered differently) names the true difference the
    gate detects with 80% power; 200 simulated gates at that difference promote 80% of the time (the old note,
    0.063 from a one-sided 5% normal approximation, was promoted about 64% of the time)."""
    seen = compare(*map(results, discordant_pairs(np.random.default_rng(3), 200, 0.13, 0.0)), "champion v1",
                   confidence=0.95, margin=0.02)  # fmt: skip
    seen.discordant = 0.13  # the note at exactly 13% discordant
    note = detectable_note(seen)
    size = float(re.search(r"a true difference of (\d\.\d+)", note).group(1))
    rng = np.random.default_rng(0)
    promoted = 0
    for _ in range(200):
        candidate, champion = discordant_pairs(rng, 200, 0.13, size)
        decision = gate(results(candidate), start=None, champion=("champion v1", results(champion)), best=None,
                        reward_change=None, **GATE)  # fmt: skip
        promoted += decision.promote
    assert 0.73 <= promoted / 200 <= 0.87, f"the note says {size} is found 80% of the time; the gate: {promoted}/200"


def test_fractional_scores_need_the_sign_test_too():
    """Sampled-mean scores: four examples up by 0.25, every other one tied. The interval lies above 0, but four
    examples are no evidence (sign test p 0.125): not promoted. Twenty up by 0.125 and none down are."""
    champion = [0.5] * 196 + [0.25, 0.5, 0.25, 0.5]
    candidate = [0.5] * 196 + [0.5, 0.75, 0.5, 0.75]
    decision = gate(results(candidate), start=None, champion=("champion v1", results(champion)), best=None,
                    reward_change=None, **GATE)  # fmt: skip
    comparison = decision.comparisons[-1]
    assert comparison.paired.low > 0 and not decision.promote
    assert comparison.p_value == 0.125 and comparison.test == "sign test" and "sign test p 0.125" in decision.reason
    text = decision_markdown("lin", "2", decision, "heldout")
    assert "| 4 / 0 | 0.125 | non-inferior |" in text and "| sign test p |" in text and "too few for the gate" in text
    many = [0.5] * 180 + [0.625] * 20
    decision = gate(results(many), start=None, champion=("champion v1", results([0.5] * 200)), best=None,
                    reward_change=None, **GATE)  # fmt: skip
    assert decision.promote and decision.reason.startswith("better than champion v1")
    text = decision_markdown("lin", "3", decision, "heldout")
    assert "in the share of examples scoring higher minus the share scoring lower" in text


def test_worse_needs_the_same_test_as_better():
    """A first version 4 of 200 answers below its start model (none above): the interval lies below 0 and below
    -margin, but McNemar's p is 0.125: not significantly worse, so promoted (as a first version not worse than its
    start model is); with 8 of 200 below it is worse (p 0.0078) and rejected."""
    start = results([1] * 150 + [0] * 50, label="start")
    four_down = gate(results([1] * 146 + [0] * 54), start=start, champion=None, best=None, reward_change=None, **GATE)
    first = four_down.comparisons[0]
    assert first.paired.high < 0 and first.paired.low < -GATE["margin"] and first.p_value == 0.125
    assert four_down.promote and four_down.reason.startswith("first version, not better than the start model")
    eight_down = gate(results([1] * 142 + [0] * 58), start=start, champion=None, best=None, reward_change=None, **GATE)
    assert not eight_down.promote and eight_down.reason.startswith("first version, worse than the start model")


def test_the_reward_hacking_alarm_needs_a_significant_drop():
    """Training reward up, held-out down by 0.03 (more than the 0.02 threshold), but 10 examples up and 13 down is
    noise (McNemar p 0.68): no alarm, and the unchanged first version is promoted. An unchanged model's raw drop
    exceeds 0.02 about a fifth of the time at n=200; a significant one 2.5% at most."""
    start = np.array([1.0] * 75 + [0.0] * 25)
    candidate = start.copy()
    candidate[:13] = 0.0  # 13 down
    candidate[75:85] = 1.0  # 10 up
    decision = gate(results(candidate), start=results(start, label="start"), champion=None, best=None,
                    reward_change=0.3, **GATE)  # fmt: skip
    assert decision.hacking is None and decision.promote, decision.reason
    assert decision.comparisons[0].paired.difference == pytest.approx(-0.03)
    rng = np.random.default_rng(2)
    alarms = raw_drops = 0
    for _ in range(60):
        final, begin = discordant_pairs(rng, 200, 0.13, 0.0)
        raw_drops += begin.mean() - final.mean() > GATE["hacking_threshold"]
        unchanged = gate(results(final), start=results(begin, label="start"), champion=None, best=None,
                         reward_change=0.1, **GATE)  # fmt: skip
        alarms += unchanged.hacking is not None
    assert raw_drops >= 8 and alarms <= 2, (raw_drops, alarms)  # about 15 and 1 of 60 expected


def test_results_the_gate_cannot_compare_get_a_decision_and_a_reason():
    """No examples, NaN scores, a best version with no results to pair with, a champion with NaN scores: never an
    exception out of the gate, never a promotion."""
    nothing = gate(results([]), start=results([], label="start"), champion=None, best=None, reward_change=None,
                   **GATE)  # fmt: skip
    assert not nothing.promote and "no results on 'heldout' (0 examples)" in nothing.reason
    nan = results([1.0, math.nan] * 50)
    for start in (None, results([1.0, 0.0] * 50, label="start")):  # a first version, with or without a start
        decision = gate(nan, start=start, champion=None, best=None, reward_change=None, **GATE)
        assert not decision.promote and "50 of 100 scores on 'heldout' that are NaN or infinite" in decision.reason
    good = results([1.0] * 90 + [0.0] * 10)
    champion = ("champion v2", results([1.0] * 60 + [0.0] * 39 + [math.nan]))
    decision = gate(good, start=None, champion=champion, best=None, reward_change=None, **GATE)
    assert not decision.promote and decision.reason.startswith("no comparison with champion v2: champion v2 has 1")
    no_best = gate(good, start=None, champion=("champion v2", results([1.0] * 60 + [0.0] * 40)),
                   best=("the lineage's best, v1", None), reward_change=None, **GATE)  # fmt: skip
    assert not no_best.promote and "the lineage's best, v1 has no results on 'heldout' to pair with" in no_best.reason
    assert "better than champion v2" in no_best.reason


def test_a_version_re_evaluated_by_a_later_run_has_results_without_a_run_of_its_own(tmp_path):
    """A version registered without a run (promoted by hand from elsewhere), whose results a later run made and
    tagged: its results are read from that run (as the lineage's best, it was None and then an AttributeError)."""
    table = {"columns": ["index", "prompt", "response", "ground_truth", "score"], "data": [[0, "p", "r", "g", 1.0]]}
    (tmp_path / "champion_v1.json").write_text(json.dumps(table))
    tags = {
        "rlflow.eval.heldout.fingerprint": "f" * 16,
        "rlflow.eval.heldout.results": "eval/heldout/champion_v1.json",
        "rlflow.eval.heldout.run": "later-run",
    }
    version = SimpleNamespace(name="lin", version="1", run_id=None, tags=tags)
    asked = []

    def download_artifacts(run_id, path, folder):
        asked.append((run_id, path))
        return str(tmp_path / "champion_v1.json")

    client = SimpleNamespace(download_artifacts=download_artifacts)
    read = version_results(client, version, "heldout", "f" * 16)
    assert read.scores == [1.0] and asked == [("later-run", "eval/heldout/champion_v1.json")]
    unrun = SimpleNamespace(name="lin", version="1", run_id=None, tags={**tags, "rlflow.eval.heldout.run": ""})
    assert version_results(client, unrun, "heldout", "f" * 16) is None


def test_the_best_versions_margin_check_asks_for_evidence():
    """A candidate significantly better than the champion and exactly as good as the lineage's best (0.900 each,
    13 examples up and 13 down of 200): the interval against the best reaches below -0.02, so the non-inferiority
    check rejects it, saying it was not shown to be within the margin (not that it is below it)."""
    best = results([1.0] * 167 + [0.0] * 13 + [1.0] * 13 + [0.0] * 7)
    champion = results([1.0] * 160 + [0.0] * 40)
    candidate = results([1.0] * 180 + [0.0] * 20)
    decision = gate(candidate, start=None, champion=("champion v3", champion), best=("the lineage's best, v1", best),
                    reward_change=None, **GATE)  # fmt: skip
    versus_best = decision.comparisons[-1].paired
    assert not decision.promote and "not shown to be less than 0.02 below the lineage's best" in decision.reason
    assert versus_best.difference == 0 and (versus_best.wins, versus_best.losses) == (13, 13)


def test_the_demo_reports_the_gates_paired_test_of_final_against_start(tmp_path):
    """`rlflow demo` prints, per phase, the final model against its start model on the same held-out examples: the
    difference, its interval, the examples up and down and the exact test (what the promotion gate would say)."""
    from flows.lineages.evaluation import EvalResults, write_results
    from flows.ops.demo import paired_test

    config = load_config("demo", [f"trainer.runs_dir={tmp_path}", "trainer.run_name=phase"])
    root = f"{tmp_path}/phase"
    start = [1.0] * 20 + [0.0] * 80  # 20 of 100 right before, 60 after: 41 up, 1 down
    final = [1.0] * 19 + [0.0] + [1.0] * 41 + [0.0] * 39
    for label, scores in (("start", start), ("final", final)):
        rows = [dict(index=i, prompt="", response="", ground_truth="", score=s) for i, s in enumerate(scores)]
        write_results(root, EvalResults("validation", label, "f" * 16, "m", rows, step=0 if label == "start" else 30))
    said = paired_test(config)
    assert said.startswith("the final model on 'validation' is better than its start model (0.600 vs 0.200")
    assert "n=100, 41 up / 1 down, McNemar p" in said


def test_the_environment_demo_counts_answers_right_at_the_first_try_and_after_feedback(tmp_path):
    from flows.lineages.evaluation import EvalResults, write_results
    from flows.ops.demo import tries

    config = load_config("agent-env", [f"trainer.runs_dir={tmp_path}", "trainer.run_name=env"])
    for label, scores in (("start", [1.0] * 3 + [0.0] * 7), ("final", [1.0] * 5 + [0.5, 1 / 3] + [0.0] * 3)):
        rows = [dict(index=i, prompt="", response="", ground_truth="", score=s) for i, s in enumerate(scores)]
        write_results(f"{tmp_path}/env", EvalResults("validation", label, "f" * 16, "m", rows))
    assert tries(config) == (
        "start model 3 of 10 right at the first try, 0 more after feedback; "
        "final model 5 of 10 right at the first try, 2 more after feedback"
    )


def test_clipped_responses_are_blamed_on_the_limit_only_when_a_reference_answer_does_not_fit():
    """The demo's validation rows: answers of 1-3 digits, each 2-4 tokens with the end of sequence; a model that has
    not learned to end them is not a limit to raise (flows/controller/runtime.py's warning)."""
    from flows.controller.run_evaluation import reference_answers_fit
    from rlworkers.data.synthetic import addition_rows
    from rlworkers.models.tiny import build_char_tokenizer

    tokenizer, data = build_char_tokenizer(), load_config("demo").data
    rows = addition_rows(num_train=1, num_val=200, max_digits=2, seed=0)["validation"]
    assert reference_answers_fit(rows, tokenizer, 4, data)  # "198" + EOS
    assert not reference_answers_fit(rows, tokenizer, 3, data)  # a 3-digit sum is cut
    chats = [{"messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]}]
    assert reference_answers_fit(chats, tokenizer, 2, data) and not reference_answers_fit(chats, tokenizer, 1, data)
    gsm8k_like = [{"prompt": "Q", "reward_model": {"ground_truth": "72"}}]  # the final number is no answer to fit
    assert not reference_answers_fit(gsm8k_like, tokenizer, 64, data)
    assert not reference_answers_fit([], tokenizer, 64, data)


def test_most_responses_cut_warn_with_the_fix_unless_every_reference_answer_fits():
    """What a run says at a training step or a validation (flows/controller/runtime.py): nothing at half the responses
    cut or fewer; a WARNING naming the setting to raise when an answer may not fit; only INFO when every one does (the
    demo's untrained model at its first steps: `make demo` shows no warning of its own)."""
    import logging

    from flows.controller.run_state import clipped_responses_note

    assert clipped_responses_note("step 1", 0.5, 4, references_fit=False) is None
    level, message = clipped_responses_note("step 1", 0.59, 4, references_fit=False)
    assert level == logging.WARNING and message.startswith("step 1: 59% of the responses hit")
    assert "Fix: raise rollout.response_length" in message
    level, message = clipped_responses_note("validation at step 0", 0.6, 4, references_fit=True)
    assert level == logging.INFO and "the model does not end its answers yet" in message
    assert "Fix" not in message
