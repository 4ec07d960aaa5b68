"""Reward functions as users bring them: verl's ``compute_score`` (per sample and batch, float or dict) and rlflow's
batch signature, loaded from files, scored through ``RuleReward``/``RewardWorker`` on batches as the rollout returns
them (verl's nested ``reward_model`` and ``extra_info`` columns), their extras as ``reward_extra/<key>`` columns and
metrics. CPU only, no Ray, a few seconds."""

from __future__ import annotations

import logging
import math
import textwrap

import cloudpickle
import numpy as np
import pytest
import torch

from rlworkers.algorithms.batch_ops import compute_data_metrics
from rlworkers.algorithms.core_algos import compute_token_level_scores
from rlworkers.data.batching import left_pad, prompt_batch
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.protocol import DataProto
from rlworkers.rewards import (
    MissingGroundTruthError,
    RewardFunctionError,
    VerlRewardFn,
    compute_reward_values,
    compute_scores,
    describe_reward_fn,
    load_reward_fn,
    reward_fn_style,
)
from rlworkers.workers.reward import RewardWorker, RuleReward, reward_columns
from rlworkers.workers.rollout import rollout_output


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from rlworkers.models.loading import load_tokenizer

    return load_tokenizer(tiny_path)


def verl_rows() -> list[dict]:
    """Prompt-batch rows of a dataset in verl's parquet layout, as they reach the reward: every dataset column,
    plus ``raw_prompt``, ``ground_truth`` (None: the dataset has no top-level answer), ``data_source`` and ``uid``."""
    rows = []
    for i, (a, b) in enumerate([(1, 11), (2, 2), (30, 4)]):
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
                "raw_prompt": f"{a}+{b}=",
                "ground_truth": None,
                "uid": f"uid-{i}",
            }
        )
    return rows


def rolled_out(tokenizer, rows: list[dict], responses: list[str]) -> DataProto:
    """A generated batch as ``generate_sequences`` returns it (``rollout_output``): the prompt and response tensors,
    and the prompt batch's non-tensor columns as object arrays (dict columns stay dicts)."""
    prompt_ids, prompt_mask = left_pad([tokenizer(row["raw_prompt"])["input_ids"] for row in rows], 0)
    response_ids = [
        tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in responses
    ]
    width = max(map(len, response_ids)) + 1
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row_ids in enumerate(response_ids):
        ids[i, : len(row_ids)], mask[i, : len(row_ids)] = torch.tensor(row_ids), 1
    columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)}
    prompts = DataProto.from_dict({"input_ids": prompt_ids, "attention_mask": prompt_mask}, columns)
    return rollout_output(prompts, ids, mask, torch.zeros(ids.shape))


VERL_FLOAT = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom_reward_function, as its docs write it: 1.0 for the right answer, plus index / 10."""
    if data_source != "openai/gsm8k":
        raise ValueError(f"unexpected data_source {data_source!r}")
    bonus = extra_info["index"] / 10 if extra_info else 0.0
    return (1.0 if solution_str.strip() == ground_truth else 0.0) + bonus
'''

VERL_DICT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "length": len(solution_str), "pred": solution_str}
"""

VERL_BATCH = """
def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [
        {"score": float(s == g), "acc": s == g, "index": e["index"]}
        for s, g, e in zip(solution_strs, ground_truths, extra_infos, strict=True)
    ]
"""

VERL_NO_SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
"""

RLFLOW_COLUMNS = """
def ability_reward(prompts, responses, **columns):
    expected = ["ability", "data_source", "extra_info", "ground_truth", "prompt", "reward_model"]
    assert sorted(columns) == expected, sorted(columns)
    assert prompts == ["1+11=", "2+2=", "30+4="], prompts
    return [float(a == "math") + len(r) for a, r in zip(columns["ability"], responses)]
"""


def write(tmp_path, name: str, source: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(source))
    return str(tmp_path / name)


def test_a_verl_reward_file_scores_through_the_rule_reward(tmp_path, tiny_path, tokenizer):
    spec = f"{write(tmp_path, 'verl_float.py', VERL_FLOAT)}:compute_score"
    batch = rolled_out(tokenizer, verl_rows(), ["12", "5", "34"])
    out = RuleReward({"reward_fn": spec}, tiny_path).compute_rm_score(batch)
    # ground_truth from reward_model (the column is None), extra_info from its column, data_source checked
    assert list(out.non_tensor_batch["score"]) == pytest.approx([1.0, 0.1, 1.2])
    assert sorted(out.non_tensor_batch) == ["score"]  # a float result has no extras
    last = batch.batch["response_mask"].sum(-1) - 1
    assert out.batch["token_level_scores"][torch.arange(3), last].tolist() == pytest.approx([1.0, 0.1, 1.2])


def test_verl_dict_results_become_reward_extra_columns_and_metrics(tmp_path, tiny_path, tokenizer, caplog):
    spec = f"{write(tmp_path, 'verl_dict.py', VERL_DICT)}:compute_score"
    batch = rolled_out(tokenizer, verl_rows(), ["12", "5", "34"])
    with caplog.at_level(logging.WARNING, logger="rlworkers.rewards.scoring"):
        out = RuleReward({"reward_fn": spec}, tiny_path).compute_rm_score(batch)
        RuleReward({"reward_fn": spec}, tiny_path).compute_rm_score(batch)  # warned once, not per call
    assert list(out.non_tensor_batch["score"]) == [1.0, -1.0, 1.0]
    assert out.non_tensor_batch["reward_extra/acc"].tolist() == [1.0, 0.0, 1.0]
    assert out.non_tensor_batch["reward_extra/length"].tolist() == [2.0, 1.0, 2.0]
    assert "reward_extra/pred" not in out.non_tensor_batch  # a string: dropped, with one warning naming it
    warnings = [r.getMessage() for r in caplog.records if "'pred'" in r.getMessage()]
    assert len(warnings) == 1 and "verl_dict.py:compute_score" in warnings[0]

    # Into the step's batch as compute_advantage merges it; the extras' means are data metrics.
    batch.union(out)
    metrics = compute_data_metrics(batch)
    assert metrics["reward_extra/acc/mean"] == pytest.approx(2 / 3)
    assert metrics["reward_extra/length/mean"] == pytest.approx(5 / 3)
    assert metrics["critic/score/mean"] == pytest.approx(1 / 3)

    # A RewardWorker scoring the rule gives the same columns.
    worker = RewardWorker({"reward_fn": spec}, tokenizer_path=tiny_path)
    worker.init_model()
    scored = worker.compute_rm_score(rolled_out(tokenizer, verl_rows(), ["12", "5", "34"]))
    assert scored.non_tensor_batch["reward_extra/acc"].tolist() == [1.0, 0.0, 1.0]


def test_verl_batch_signature(tmp_path, tiny_path, tokenizer):
    spec = f"{write(tmp_path, 'verl_batch.py', VERL_BATCH)}:compute_score"
    assert isinstance(load_reward_fn(spec), VerlRewardFn) and load_reward_fn(spec).style == "verl_batch"
    out = RuleReward({"reward_fn": spec}, tiny_path).compute_rm_score(
        rolled_out(tokenizer, verl_rows(), ["12", "4", "3"])
    )
    assert list(out.non_tensor_batch["score"]) == [1.0, 1.0, 0.0]
    assert out.non_tensor_batch["reward_extra/acc"].tolist() == [1.0, 1.0, 0.0]
    assert out.non_tensor_batch["reward_extra/index"].tolist() == [0.0, 1.0, 2.0]


def test_an_rlflow_function_gets_every_dataset_column(tmp_path, tiny_path, tokenizer):
    spec = f"{write(tmp_path, 'columns.py', RLFLOW_COLUMNS)}:ability_reward"
    assert reward_fn_style(load_reward_fn(spec)) == "rlflow"
    batch = rolled_out(tokenizer, verl_rows(), ["12", "5", "34"])
    # Columns a reward wrote earlier (a re-scored batch) are not passed back to it, nor uid and raw_prompt.
    batch.non_tensor_batch["score"] = np.array([0.0] * 3, dtype=object)
    batch.non_tensor_batch["reward_extra/acc"] = np.zeros(3)
    assert sorted(reward_columns(batch)) == [
        "ability",
        "data_source",
        "extra_info",
        "ground_truth",
        "prompt",
        "reward_model",
    ]
    assert reward_columns(batch)["reward_model"][2] == {"style": "rule", "ground_truth": "34"}
    out = RuleReward({"reward_fn": spec}, tiny_path).compute_rm_score(batch)
    assert list(out.non_tensor_batch["score"]) == [3.0, 2.0, 3.0]


def test_a_row_without_a_ground_truth_is_refused_by_number(tiny_path, tokenizer):
    rows = verl_rows()
    rows[1]["reward_model"] = {"style": "rule"}  # neither ground_truth nor reward_model.ground_truth
    batch = rolled_out(tokenizer, rows, ["#### 12", "#### 4", "#### 34"])
    for name in ("gsm8k", "exact", "auto"):
        with pytest.raises(MissingGroundTruthError, match=r"row 1 has no ground truth: add an 'answer'/'ground_truth'"):
            RuleReward({"reward_fn": name}, tiny_path).compute_rm_score(batch)
    rows[1]["reward_model"]["ground_truth"] = "4"  # the same batch with it scores
    scored = RuleReward({"reward_fn": "auto"}, tiny_path).compute_rm_score(
        rolled_out(tokenizer, rows, ["#### 12", "#### 4", "#### 3"])
    )
    assert list(scored.non_tensor_batch["score"]) == [1.0, 1.0, 0.0]
    # auto groups rows by data_source: the row number is the batch's, not the group's
    with pytest.raises(ValueError, match=r"row 2 has no ground truth"):
        compute_scores(
            load_reward_fn("auto"),
            ["a", "b", "c"],
            ["1", "#### 2", "#### 3"],
            ground_truth=["1", "2", None],
            data_source=["addition", "gsm8k", "gsm8k"],
        )


def test_a_dict_without_score_is_refused_naming_the_function(tmp_path, tiny_path, tokenizer):
    spec = f"{write(tmp_path, 'no_score.py', VERL_NO_SCORE)}:compute_score"
    batch = rolled_out(tokenizer, verl_rows(), ["12", "5", "34"])
    with pytest.raises(
        ValueError, match=r"no_score\.py:compute_score returned a dict without 'score' for row 0"
    ) as info:
        RuleReward({"reward_fn": spec}, tiny_path).compute_rm_score(batch)
    assert "{'score': 1.0" in str(info.value)  # the fix


def test_a_verl_function_from_a_file_survives_cloudpickle(tmp_path):
    path = write(tmp_path, "verl_dict.py", VERL_DICT)
    fn = load_reward_fn(f"{path}:compute_score")
    blob = cloudpickle.dumps(fn)
    (tmp_path / "verl_dict.py").unlink()  # shipped by value: a Ray worker need not see the file
    restored = cloudpickle.loads(blob)
    assert isinstance(restored, VerlRewardFn) and describe_reward_fn(restored) == f"{path}:compute_score"
    columns = {"ground_truth": ["4", None], "reward_model": [None, {"ground_truth": "5"}], "data_source": ["x", "y"]}
    scores, extras = compute_reward_values(restored, ["p", "q"], ["4", "6"], **columns)
    assert scores == [1.0, -1.0] and extras == {"acc": [1.0, 0.0], "length": [1.0, 1.0]}


def test_signatures_are_recognised_by_parameter_names(tmp_path):
    def rlflow(prompts, responses, **columns):
        return [0.0] * len(responses)

    def verl_without_extra_info(solution_str, ground_truth):
        return float(solution_str == ground_truth)

    def verl_with_kwargs(data_source, solution_str, ground_truth, **kwargs):
        return float(kwargs["extra_info"] is None and data_source is None)

    def verl_needing_more(data_source, solution_str, ground_truth, extra_info, method):
        return 0.0

    assert load_reward_fn(rlflow) is rlflow  # unchanged
    assert reward_fn_style(print) == "rlflow"  # no signature to read: today's behaviour
    assert compute_scores(load_reward_fn(verl_without_extra_info), ["p", "q"], ["1", "2"], ground_truth=["1", "1"]) == [
        1.0,
        0.0,
    ]
    assert compute_scores(load_reward_fn(verl_with_kwargs), ["p"], ["1"]) == [1.0]  # no columns: None each
    with pytest.raises(ValueError, match=r"verl_needing_more has verl's .* also requires \['method'\]"):
        load_reward_fn(verl_needing_more)
    # A raising verl function is named, with the line in it that raised (not the wrapper's).
    (tmp_path / "broken.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth):\n    return 1 / 0\n"
    )
    with pytest.raises(
        RewardFunctionError, match=r"broken\.py:compute_score raised ZeroDivisionError.*broken\.py line 2"
    ):
        compute_scores(load_reward_fn(f"{tmp_path / 'broken.py'}:compute_score"), ["p"], ["r"])


def test_rlflow_batch_functions_may_return_dicts():
    def batch(prompts, responses, **columns):
        return [{"score": 1, "acc": np.bool_(True), "len": torch.tensor(2.0)}, {"score": 0.5}, 0.0]

    scores, extras = compute_reward_values(batch, ["a", "b", "c"], ["x", "y", "z"])
    assert scores == [1.0, 0.5, 0.0]
    assert extras["acc"][0] == 1.0 and math.isnan(extras["acc"][1]) and math.isnan(extras["acc"][2])
    assert extras["len"][0] == 2.0
    assert compute_scores(batch, ["a", "b", "c"], ["x", "y", "z"]) == [1.0, 0.5, 0.0]  # existing callers: floats

    # A row without an extra is NaN and left out of the metric's mean.
    data = DataProto.from_dict(
        {
            "token_level_scores": compute_token_level_scores(torch.tensor(scores), torch.ones(3, 2)),
            "response_mask": torch.ones(3, 2),
            "prompts": torch.ones(3, 1),
            "attention_mask": torch.ones(3, 3),
        },
        {"reward_extra/acc": np.asarray(extras["acc"]), "reward_extra/none": np.full(3, np.nan)},
    )
    metrics = compute_data_metrics(data)
    assert metrics["reward_extra/acc/mean"] == 1.0 and "reward_extra/none/mean" not in metrics

    with pytest.raises(ValueError, match="rename those columns"):
        compute_scores(batch, ["a"], ["x"], responses=["y"])


def test_verl_rows_from_prompt_batch_reach_a_verl_function(tmp_path, tiny_path, tokenizer):
    """The whole path: verl-layout rows (no answer column; string prompts, as the tiny tokenizer has no chat
    template) through prompt_batch to the reward."""
    spec = f"{write(tmp_path, 'verl_batch.py', VERL_BATCH)}:compute_score"
    rows = [
        {
            **{k: v for k, v in row.items() if k not in ("raw_prompt", "ground_truth", "uid")},
            "prompt": row["raw_prompt"],
        }
        for row in verl_rows()
    ]
    prompts = prompt_batch(rows, tokenizer)
    ids = torch.tensor(
        [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in ["12", "40", "34"]]
    )
    out = RuleReward({"reward_fn": spec}, tiny_path).compute_rm_score(
        rollout_output(prompts, ids, torch.ones_like(ids), torch.zeros(ids.shape))
    )
    assert list(out.non_tensor_batch["score"]) == [1.0, 0.0, 1.0]
    assert out.non_tensor_batch["reward_extra/index"].tolist() == [0.0, 1.0, 2.0]


def test_which_rewards_need_a_ground_truth():
    from rlworkers.rewards import REWARD_FUNCTIONS, as_batch_reward_fn, auto_reward, needs_ground_truth

    assert needs_ground_truth(REWARD_FUNCTIONS["exact"]) and needs_ground_truth(REWARD_FUNCTIONS["gsm8k"])
    assert not needs_ground_truth(REWARD_FUNCTIONS["format"])
    assert needs_ground_truth(auto_reward, "gsm8k") and not needs_ground_truth(auto_reward, "no-such-source")

    def verl_needs(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    def verl_optional(data_source, solution_str, ground_truth=None, extra_info=None):
        return 0.0

    def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        return [0.0] * len(solution_strs)

    def rlflow_fn(prompts, responses, **columns):
        return [0.0] * len(responses)

    assert needs_ground_truth(as_batch_reward_fn(verl_needs))
    assert not needs_ground_truth(as_batch_reward_fn(verl_optional))
    assert needs_ground_truth(as_batch_reward_fn(verl_batch))
    assert not needs_ground_truth(rlflow_fn)  # gets ground_truth None for such rows, as documented
    rlflow_fn.needs_ground_truth = True  # ... unless it says it compares with one
    assert needs_ground_truth(rlflow_fn)
