"""Tests for rlworkers.models (tiny model, loading), rlworkers.data (datasets, loader, addition task) and
rlworkers.rewards (rule rewards, registry, user reward loading). CPU only, a few seconds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlworkers.data import PromptDataLoader, ensure_addition_dataset, load_prompt_dataset, make_addition_dataset
from rlworkers.data.batching import TokenCache, decode_responses, left_pad, prompt_batch, sft_batch
from rlworkers.models import create_tiny_model, ensure_tiny_model, load_model_and_tokenizer
from rlworkers.models.loading import model_card_data
from rlworkers.protocol import DataProto
from rlworkers.rewards import (
    compute_scores,
    exact_answer_reward,
    extract_gsm8k_answer,
    format_reward,
    gsm8k_reward,
    load_reward_fn,
    reward_fn_for_data_source,
)

# ---------------------------------------------------------------- models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model_and_tokenizer(tiny_dir)


def test_tiny_model_reloads_with_auto_classes(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (tiny_dir / "model.safetensors").is_file()
    assert model.config.vocab_size == len(tokenizer)
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")


@pytest.mark.parametrize("text", ["12+34=46", "Is 2 + 2 = 4 ? yes , it is .\n#### 4"])
def test_tokenizer_round_trips_characters(tiny, text):
    _, tokenizer = tiny
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_forward_gives_vocab_sized_logits(tiny):
    model, tokenizer = tiny
    batch = tokenizer(["12+34=46"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, 9, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_generate_with_left_padding_matches_unpadded(tiny):
    model, tokenizer = tiny
    assert tokenizer.padding_side == "left"
    prompts = ["1+1=", "123+45="]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0  # the short prompt is padded on the left
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 4
    for row, prompt in enumerate(prompts):
        single = tokenizer([prompt], return_tensors="pt")
        alone = model.generate(**single, max_new_tokens=4, do_sample=False)[0, single["input_ids"].shape[1] :]
        assert torch.equal(out[row, prompt_len : prompt_len + len(alone)], alone)


def test_tiny_model_is_deterministic_and_ensure_is_idempotent(tmp_path, tiny_dir):
    a = create_tiny_model(tmp_path / "a", seed=0)
    b = create_tiny_model(tmp_path / "b", seed=1)
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_dir) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before
    assert (a / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert (b / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_ensure_refuses_a_partial_folder(tmp_path):
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="partial"):
        ensure_tiny_model(tmp_path / "partial")


def test_workers_and_flows_import_without_scikit_learn_scipy_optimize_or_boto3():
    # all three are installed (mlflow needs the first two, object storage boto3), but transformers (and accelerate)
    # would import them in every worker for nothing (mlflow itself imports scipy.sparse in the flow's process)
    code = (
        "import sys; import rlworkers.workers.actor_rollout_ref, rlworkers.workers.critic; "
        "from transformers import GenerationMixin; "
        "in_workers = [m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy', 'boto3', 'botocore')]; "
        "assert not in_workers, in_workers[:3]; "
        "import flows.grpo, flows.ppo; "
        "in_flows = [m for m in sys.modules if m.startswith(('sklearn', 'scipy.optimize', 'boto3'))]; "
        "assert not in_flows, in_flows[:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_transformers_tables_are_made_once_then_read_from_disk_and_equal_transformers_own(tmp_path):
    """rlworkers/transformers_import.py: the first process makes transformers' model table and the distributions'
    map and keeps them on disk; the next reads them (transformers' own function is not called for the models
    folder); a corrupt file is made again; both equal what transformers makes; the lazy classes still import."""
    code = (
        "import json, sys, importlib.metadata, rlworkers, transformers; "
        "from transformers import AutoModelForCausalLM, LlamaForCausalLM; "
        "from transformers.utils import import_utils; "
        "wrapper = import_utils.create_import_structure_from_path; "
        "calls = wrapper.build.cache_info().misses; "
        "folder = transformers.__file__.rsplit('/', 1)[0] + '/models'; "
        "made = wrapper.build.__wrapped__(folder); "
        "mapping = import_utils.PACKAGE_DISTRIBUTION_MAPPING == importlib.metadata.packages_distributions(); "
        "print(json.dumps({'calls': calls, 'same': wrapper(folder) == made and mapping, "
        "'class': LlamaForCausalLM.__name__}))"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    first = run()
    assert first["calls"] > 500 and first["same"] and first["class"] == "LlamaForCausalLM"  # ~520 model folders
    (table,) = (tmp_path / "rlflow").glob("transformers-import-structure-*.json")
    (mapping,) = (tmp_path / "rlflow").glob("packages-distributions-*.json")
    assert "torch" in json.loads(mapping.read_text())["value"]
    second = run()  # made here: only the folders of the model packages imported (each reads its own when imported)
    assert second["calls"] < 20 and second["same"] and second["class"] == "LlamaForCausalLM"
    table.write_text('{"key": "')  # cut off mid-write, as by a full disk
    mapping.write_text('{"key": "another environment", "value": {}}')
    third = run()
    assert third["calls"] > 500 and third["same"] and json.loads(table.read_text())["value"]
    assert "torch" in json.loads(mapping.read_text())["value"]
    assert run()["calls"] < 20


def test_a_trained_model_inherits_its_start_models_license_and_base(tmp_path, tiny_dir):
    """What flows/controller/run_publish.py writes into a final model's card (MLflow logs the card with the model)."""
    assert model_card_data("tiny") == model_card_data(f"tiny:{tiny_dir}") == {"license": "apache-2.0"}
    assert model_card_data(tiny_dir) == {"license": "apache-2.0"}  # any folder with a tiny model: its own card
    smollm2 = {"license": "apache-2.0", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert model_card_data("smollm2-135m-instruct") == smollm2
    trained = tmp_path / "final_model"  # a model rlflow trained carries its card on to the next run
    trained.mkdir()
    (trained / "README.md").write_text("---\nlicense: mit\nbase_model: org/base\ntags: [rlflow]\n---\n# v1\n")
    assert model_card_data(trained) == {"license": "mit", "base_model": "org/base"}
    assert model_card_data(tmp_path / "no-card") == model_card_data("org/hub-name") == {}


def test_unknown_dtype_is_rejected(tiny_dir):
    with pytest.raises(ValueError, match="float32"):
        load_model_and_tokenizer(tiny_dir, dtype="float8")


# ---------------------------------------------------------------- data


def test_addition_dataset_is_written_disjoint_and_deterministic(tmp_path):
    paths = make_addition_dataset(tmp_path / "a", num_train=300, num_val=50, max_digits=2, seed=3)
    again = make_addition_dataset(tmp_path / "b", num_train=300, num_val=50, max_digits=2, seed=3)
    other = make_addition_dataset(tmp_path / "c", num_train=300, num_val=50, max_digits=2, seed=4)
    train, val = pq.read_table(paths["train"]).to_pylist(), pq.read_table(paths["validation"]).to_pylist()
    assert (len(train), len(val)) == (300, 50)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert pq.read_table(again["train"]).to_pylist() == train
    assert pq.read_table(other["train"]).to_pylist() != train
    for row in train[:20]:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["answer"] == row["response"] == str(int(a) + int(b))
        assert row["data_source"] == "addition"


def test_addition_dataset_too_many_problems(tmp_path):
    with pytest.raises(ValueError, match="only 100 exist"):
        make_addition_dataset(tmp_path, num_train=90, num_val=20, max_digits=1)


def test_ensure_addition_dataset_regenerates_on_new_params(tmp_path):
    first = ensure_addition_dataset(tmp_path, num_train=20, num_val=5)
    assert len(load_prompt_dataset(first["train"])) == 20
    second = ensure_addition_dataset(tmp_path, num_train=30, num_val=5)
    assert len(load_prompt_dataset(second["train"], required_columns=("answer",))) == 30


def test_the_dataset_is_readable_whole_while_another_run_writes_it_again(tmp_path):
    """Two runs that start at once on one runs_dir both write the built-in task's folder; the one that reads while
    the other writes must never see a torn file (seen in CI: two lineages at once, one failing on its data)."""
    import threading

    paths = make_addition_dataset(tmp_path)
    writing, torn = True, []

    def write_again():
        while writing:
            make_addition_dataset(tmp_path)

    writer = threading.Thread(target=write_again)
    writer.start()
    try:
        for _ in range(200):
            try:
                assert pq.read_table(paths["train"]).num_rows == 2000
            except Exception as error:  # ArrowInvalid from a half-written file
                torn.append(repr(error)[:80])
    finally:
        writing = False
        writer.join()
    assert not torn, f"{len(torn)} of 200 reads saw a torn file: {torn[0]}"


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1="}\n\n{"prompt": "2+2=\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl line 3: invalid JSON"):
        load_prompt_dataset(str(path))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "x"}', "missing value for column 'prompt'"),
        ('{"prompt": 5}', "must be a string"),
        ('{"prompt": "  "}', "is empty"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_jsonl_invalid_rows(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"p\.jsonl line 2: .*{message}"):
        load_prompt_dataset(path)


def test_jsonl_reads_rows_and_custom_prompt_key(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+1=", "answer": str(i + 1)}) for i in range(4)) + "\n")
    rows = load_prompt_dataset(path, prompt_key="q", required_columns=("answer",))
    assert [r["answer"] for r in rows] == ["1", "2", "3", "4"]


def test_prompts_longer_than_the_limit_are_named_before_training(tmp_path, tiny):
    _, tokenizer = tiny  # BOS + one token per character
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1="}\n\n{"prompt": "12345+67890="}\n{"prompt": "99+1="}\n')
    assert len(load_prompt_dataset(path, tokenizer=tokenizer, max_prompt_length=13)) == 3
    with pytest.raises(
        ValueError,
        match=r"p\.jsonl line 3: the prompt has 13 tokens, more than "
        r"data\.max_prompt_length=8 \(1 row\(s\) of this file",
    ):
        load_prompt_dataset(path, tokenizer=tokenizer, max_prompt_length=8)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1="}, {"prompt": "123+456="}]), parquet)
    with pytest.raises(ValueError, match=r"p\.parquet row 1 \(0-based\): the prompt has 9 tokens"):
        load_prompt_dataset(parquet, tokenizer=tokenizer, max_prompt_length=8)


def test_parquet_missing_prompt_column(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+1=", "answer": "2"}]), path)
    with pytest.raises(ValueError, match=r"p\.parquet: missing column\(s\) \['prompt'\]"):
        load_prompt_dataset(path)
    with pytest.raises(ValueError, match=r"\['solution'\]"):
        load_prompt_dataset(path, prompt_key="question", required_columns=("solution",))


def test_parquet_bad_row_is_named_by_index(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": "b"}, {"prompt": ""}]), path)
    with pytest.raises(ValueError, match=r"row 2 \(0-based\)"):
        load_prompt_dataset(path)


def test_unknown_extension(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_prompt_dataset(tmp_path / "p.csv")


def _rows(n):
    return [{"prompt": f"{i}+0=", "i": i} for i in range(n)]


def _ids(batch):
    return [r["i"] for r in batch]


def test_loader_covers_each_epoch_and_reshuffles():
    loader = PromptDataLoader(_rows(10), batch_size=3, seed=7)
    assert len(loader) == 3
    first = [_ids(b) for b in loader]
    second = [_ids(b) for b in loader]
    assert len(first) == 3 and all(len(b) == 3 for b in first)
    assert len(set(sum(first, []))) == 9
    assert first != second and loader.epoch == 2


def test_loader_resume_yields_the_same_next_batch():
    uninterrupted = PromptDataLoader(_rows(10), batch_size=3, seed=1)
    expected = [_ids(uninterrupted.next_batch()) for _ in range(8)]

    interrupted = PromptDataLoader(_rows(10), batch_size=3, seed=1)
    seen = [_ids(interrupted.next_batch()) for _ in range(4)]  # stops in the middle of epoch 1
    state = json.loads(json.dumps(interrupted.state_dict()))  # checkpoints store it as JSON
    assert state["epoch"] == 1 and state["position"] == 1

    resumed = PromptDataLoader(_rows(10), batch_size=3, seed=999)
    resumed.load_state_dict(state)
    seen += [_ids(resumed.next_batch()) for _ in range(4)]
    assert seen == expected


def test_batches_are_left_padded_with_hand_values(tiny):
    _, tokenizer = tiny
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids, mask = left_pad([[5, 6, 7], [8], []], pad)
    assert ids.tolist() == [[5, 6, 7], [pad, pad, 8], [pad, pad, pad]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]

    rows = [{"prompt": "12+3=", "response": 15, "answer": "15"}, {"prompt": "1+1=", "response": "2", "answer": "2"}]
    one_by_one = [tokenizer(row["prompt"])["input_ids"] for row in rows]  # what the batched call must match
    prompts = prompt_batch(rows, tokenizer)
    width = max(map(len, one_by_one))
    assert prompts.batch["input_ids"].tolist() == [[pad] * (width - len(p)) + p for p in one_by_one]
    assert prompts.batch["position_ids"][1].tolist() == [0] * (width - len(one_by_one[1])) + list(
        range(len(one_by_one[1]))
    )

    sft = sft_batch(rows, tokenizer)
    response = tokenizer("15", add_special_tokens=False)["input_ids"] + [eos]
    assert sft.batch["input_ids"][0].tolist()[-len(response) :] == response
    assert sft.batch["loss_mask"][0].tolist() == [0] * len(one_by_one[0]) + [1] * len(response)
    assert sft.batch["attention_mask"][1].sum() == len(one_by_one[1]) + 2  # "2" + eos


def test_responses_decode_to_their_masked_in_text_without_the_final_eos(tiny):
    _, tokenizer = tiny
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    one, two, plus = (tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in "12+")
    responses = torch.tensor([[one, two, eos, pad], [two, eos, one, eos], [one, plus, one, two], [pad] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    batch = DataProto.from_dict({"responses": responses, "response_mask": mask})
    # an EOS inside a response is a special token (skipped), only the last one ends it; masked-out tokens are not text
    assert decode_responses(batch, tokenizer) == ["12", "21", "1+", ""]


def test_the_token_cache_gives_the_tokenizers_ids_and_tokenizes_each_text_once(tiny):
    _, tokenizer = tiny
    calls = []

    def counting(texts, **kwargs):
        calls.append(list(texts))
        return tokenizer(texts, **kwargs)

    rows = [
        {"prompt": "12+3=", "response": "15"},
        {"prompt": "1+1=", "response": "2"},
        {"prompt": "12+3=", "response": "15"},
    ]
    cache = TokenCache(counting)
    cache.pad_token_id, cache.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id  # counting has none
    for _ in range(3):  # three epochs
        assert (
            sft_batch(rows, cache).batch["input_ids"].tolist() == sft_batch(rows, tokenizer).batch["input_ids"].tolist()
        )
        assert (
            prompt_batch(rows, cache).batch["input_ids"].tolist()
            == prompt_batch(rows, tokenizer).batch["input_ids"].tolist()
        )
    assert calls == [["12+3=", "1+1="], ["15", "2"]]  # prompts with special tokens, responses without: once each

    small = TokenCache(counting, max_tokens=len(tokenizer("12+3=")["input_ids"]))  # room for the first prompt only
    calls.clear()
    for _ in range(2):
        assert small(["12+3=", "1+1="])["input_ids"] == tokenizer(["12+3=", "1+1="])["input_ids"]
    assert calls == [["12+3=", "1+1="], ["1+1="]] and small.cached_tokens <= small.max_tokens
    assert TokenCache(tokenizer).decode([5]) == tokenizer.decode([5])  # the rest is the tokenizer's
    assert TokenCache(tokenizer)("12+3=")["input_ids"] == tokenizer("12+3=")["input_ids"]  # one text, as the tokenizer


def test_loader_state_from_another_dataset_is_rejected():
    state = PromptDataLoader(_rows(10), batch_size=3).state_dict()
    with pytest.raises(ValueError, match="num_rows=10"):
        PromptDataLoader(_rows(12), batch_size=3).load_state_dict(state)


# ---------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 5+3=8\n#### 8", "8"),
        ("#### 1,234", "1234"),
        ("The total is #### $1,234.50", "1234.50"),
        ("#### -7", "-7"),
        ("first #### 3 then #### 4", "4"),
        ("The answer is 42.", None),
        ("####", None),
    ],
)
def test_extract_gsm8k_answer_strict(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_extract_gsm8k_answer_flexible():
    assert extract_gsm8k_answer("I think it is 1,000 apples, not 3.", method="flexible") == "3"
    with pytest.raises(ValueError, match="strict"):
        extract_gsm8k_answer("#### 1", method="loose")


def test_gsm8k_reward_and_exact_and_format():
    assert gsm8k_reward("work... #### 72", "72") == 1.0
    assert gsm8k_reward("#### 72.0", "Natalia sold 48/2 = 24 ... #### 72") == 1.0
    assert gsm8k_reward("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_reward("no answer", "72", format_score=0.1) == 0.0
    assert exact_answer_reward(" 46\n", "46") == 1.0
    assert exact_answer_reward("466", "46") == 0.0
    assert format_reward("#### 3") == 1.0 and format_reward("3") == 0.0


def test_registered_rewards_and_data_source_defaults():
    exact = load_reward_fn("exact")
    assert compute_scores(exact, ["1+1=", "2+2="], ["2", "5"], answer=["2", "4"]) == [1.0, 0.0]
    assert reward_fn_for_data_source("addition") is exact
    auto = load_reward_fn("auto")
    scores = compute_scores(
        auto,
        ["a", "b", "c"],
        ["2", "#### 3", "#### 4"],
        answer=["2", "3", "5"],
        data_source=["addition", "gsm8k", "openai/gsm8k"],
    )
    assert scores == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="'answer'"):
        compute_scores(exact, ["p"], ["r"], data_source=["addition"])
    with pytest.raises(ValueError, match="no default reward for data_source 'mystery'"):
        reward_fn_for_data_source("mystery")


USER_REWARD = """
def length_reward(prompts, responses, **columns):
    return [float(len(r)) for r in responses]

def wrong_length(prompts, responses, **columns):
    return [1.0]

def not_finite(prompts, responses, **columns):
    return [float("nan")] * len(responses)

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def test_user_reward_from_file(user_reward_file):
    fn = load_reward_fn(f"{user_reward_file}:length_reward")
    assert compute_scores(fn, ["p", "q"], ["ab", "abcd"], answer=["x", "y"]) == [2.0, 4.0]
    # The file's module is not left in sys.modules (so cloudpickle ships the function by value).
    assert not [name for name in sys.modules if "my_reward" in name]


def test_user_reward_from_module(user_reward_file, monkeypatch):
    package = user_reward_file.parent / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(user_reward_file.parent))
    fn = load_reward_fn("userpkg.scoring:length_reward")
    assert compute_scores(fn, ["p"], ["abc"]) == [3.0]


def test_compute_scores_names_the_function_on_bad_results(user_reward_file):
    wrong = load_reward_fn(f"{user_reward_file}:wrong_length")
    with pytest.raises(ValueError, match=r"my_reward\.py:wrong_length returned 1 scores for 2 responses"):
        compute_scores(wrong, ["p", "q"], ["a", "b"])
    nan = load_reward_fn(f"{user_reward_file}:not_finite")
    with pytest.raises(ValueError, match=r"not_finite returned non-finite scores at positions \[0\]"):
        compute_scores(nan, ["p"], ["a"])
    with pytest.raises(ValueError, match="lengths"):
        compute_scores(load_reward_fn("exact"), ["p"], ["a", "b"], answer=["a", "b"])
    with pytest.raises(ValueError, match="must return a list"):
        compute_scores(lambda p, r, **c: math.pi, ["p"], ["a"])


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("no_such_reward", "not a registered name"),
        ("{dir}/missing.py:fn", "does not exist"),
        ("{dir}/my_reward.py:absent", "has no attribute 'absent'"),
        ("{dir}/my_reward.py:NOT_A_FUNCTION", "not a function"),
        ("{dir}/my_reward.py:bad-name", "not a function name"),
        ("surely_not_a_module_xyz:fn", "cannot be imported"),
        ("", "non-empty string"),
    ],
)
def test_bad_reward_specs(user_reward_file, spec, why):
    spec = spec.format(dir=user_reward_file.parent)
    with pytest.raises(ValueError, match="Accepted forms") as info:
        load_reward_fn(spec)
    assert why in str(info.value) and repr(spec) in str(info.value)


def test_tiny_name_creates_the_model_on_demand(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_TINY_MODEL_DIR", str(tmp_path / "cache" / "tiny"))
    model, tokenizer = load_model_and_tokenizer("tiny", dtype="bfloat16")
    assert (tmp_path / "cache" / "tiny" / "config.json").is_file()
    assert model.dtype == torch.bfloat16 and tokenizer.padding_side == "left"


def test_datasets_go_through_fsspec_urls():
    paths = make_addition_dataset("memory://rlflow-test/addition", num_train=12, num_val=4, seed=0)
    assert paths["train"] == "memory://rlflow-test/addition/train.parquet"
    rows = load_prompt_dataset(paths["validation"], required_columns=("answer", "data_source"))
    assert len(rows) == 4 and rows[0]["extra_info"]["split"] == "validation"
