"""A user's data as verl writes it: chat-message prompts rendered with the tokenizer's chat template, verl's parquet
layout (nested ``reward_model`` and ``extra_info``) loaded unchanged, every column carried to the reward, prompts cut
on request, SFT conversations with the loss on the assistant turns. The tiny character tokenizer gets a small chat
template of characters it knows; tests/test_real_model.py does the same with SmolLM2's real ChatML template."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.config import ConfigError, load_config
from rlworkers.data.batching import ground_truth_of, prompt_batch, sft_batch
from rlworkers.data.chat import conversation_as_prompt, conversation_tokens, render_prompt
from rlworkers.data.datasets import load_prompt_dataset
from rlworkers.models.tiny import build_char_tokenizer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture
def tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def verl_gsm8k_row(index: int, question: str, answer: int) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": question + ' Let\'s think step by step and output the final answer after "####".',
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": "train", "index": index, "answer": f"so #### {answer}", "question": question},
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_verl_parquet_loads_unchanged_and_every_column_reaches_the_batch(tmp_path, tokenizer):
    rows = [verl_gsm8k_row(0, "What is 2+3?", 5), verl_gsm8k_row(1, "What is 10+7?", 17)]
    path = write_parquet(tmp_path / "train.parquet", rows)
    loaded = load_prompt_dataset(path, tokenizer=tokenizer, max_prompt_length=200)
    assert loaded[0]["reward_model"] == {"style": "rule", "ground_truth": "5"}
    assert loaded[1]["extra_info"]["index"] == 1

    batch = prompt_batch(loaded, tokenizer).repeat(2, interleave=True)  # as the rollout returns it, n=2
    columns = batch.non_tensor_batch
    assert list(columns["ground_truth"]) == ["5", "5", "17", "17"]  # from reward_model: no 'answer' column needed
    assert list(columns["data_source"]) == ["openai/gsm8k"] * 4
    assert columns["reward_model"][2] == {"style": "rule", "ground_truth": "17"}
    assert columns["extra_info"][3]["question"] == "What is 10+7?"
    assert list(columns["ability"]) == ["math"] * 4
    assert columns["prompt"][0] == rows[0]["prompt"]  # the messages themselves, too
    expected = "user: " + rows[0]["prompt"][0]["content"] + "\nassistant: "
    assert columns["raw_prompt"][0] == expected
    # the rendered prompt is tokenized without the tokenizer's BOS (the template writes what it needs), as verl does
    first = batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()].tolist()
    assert first == tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_string_and_chat_prompts_mix_and_strings_keep_their_special_tokens(tokenizer):
    rows = [{"prompt": "1+2=", "answer": 3}, {"prompt": [{"role": "user", "content": "1+2"}], "answer": "3"}]
    batch = prompt_batch(rows, tokenizer)
    ids = [ids[mask.bool()].tolist() for ids, mask in zip(batch.batch["input_ids"], batch.batch["attention_mask"])]
    assert ids[0] == tokenizer("1+2=")["input_ids"] and ids[0][0] == tokenizer.bos_token_id
    assert ids[1] == tokenizer("user: 1+2\nassistant: ", add_special_tokens=False)["input_ids"]
    assert list(batch.non_tensor_batch["ground_truth"]) == ["3", "3"]  # numbers become text


def test_ground_truth_comes_from_the_answer_then_ground_truth_then_reward_model():
    assert ground_truth_of({"answer": "1", "ground_truth": "2", "reward_model": {"ground_truth": "3"}}) == "1"
    assert ground_truth_of({"ground_truth": "2", "reward_model": {"ground_truth": "3"}}) == "2"
    assert ground_truth_of({"reward_model": {"style": "rule", "ground_truth": "3"}}) == "3"
    assert ground_truth_of({"sol": 4}, answer_key="sol") == "4"
    assert ground_truth_of({"prompt": "x"}) is None  # a rule reward refuses the row rather than scoring ""


def test_bad_chat_rows_are_reported_with_their_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    good = {"prompt": [{"role": "user", "content": "hi"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": [{"content": "no role"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: column 'prompt', message 0: expected \{'role'"):
        load_prompt_dataset(str(path))
    path.write_text(json.dumps({"prompt": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="line 1.*unknown role 'robot'"):
        load_prompt_dataset(str(path))
    path.write_text(json.dumps({"prompt": {"role": "user"}}) + "\n")
    with pytest.raises(ValueError, match="line 1: column 'prompt' must be a string or a list of chat messages"):
        load_prompt_dataset(str(path))


def test_chat_prompts_need_a_chat_template(tmp_path):
    path = write_parquet(tmp_path / "chat.parquet", [verl_gsm8k_row(0, "What is 1+1?", 2)])
    plain = build_char_tokenizer()
    with pytest.raises(ValueError, match="has no chat template. Fix: use a chat"):
        load_prompt_dataset(path, tokenizer=plain, max_prompt_length=100)


def test_long_prompts_fail_the_load_or_are_cut_when_asked(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "12345678+1=", "answer": "12345679"}]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match="long.jsonl line 2: the prompt has 12 tokens.*data.truncation=left"):
        load_prompt_dataset(str(path), tokenizer=tokenizer, max_prompt_length=6)
    with caplog.at_level(logging.WARNING):
        loaded = load_prompt_dataset(str(path), tokenizer=tokenizer, max_prompt_length=6, truncation="left")
    assert "data.truncation=left cuts them" in caplog.text
    for truncation, kept in (("left", "678+1="), ("right", "<bos>12345")):  # verl's meanings: left keeps the end
        batch = prompt_batch(loaded, tokenizer, max_prompt_length=6, truncation=truncation)
        assert batch.batch["input_ids"].shape[1] == 6
        assert tokenizer.decode(batch.batch["input_ids"][1]) == kept
    with pytest.raises(ValueError, match="batch row 1 has 12 tokens"):
        prompt_batch(loaded, tokenizer, max_prompt_length=6)


def test_sft_conversation_learns_only_the_assistant_turns(tokenizer):
    conversation = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = conversation_tokens(conversation, tokenizer)
    learned = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert learned == "3\n4\n"  # each reply and its end of turn; never the roles, the system or the user
    assert tokenizer.decode(ids) == render_prompt(conversation, tokenizer)[: -len("assistant: ")]

    rows = [{"messages": conversation}, {"prompt": [{"role": "user", "content": "5+5"}], "response": "10"}]
    batch = sft_batch(rows, tokenizer)
    row_mask = batch.batch["loss_mask"].bool()
    targets = [tokenizer.decode(batch.batch["input_ids"][i][row_mask[i]]) for i in range(2)]
    assert targets[0] == "3\n4\n"
    assert targets[1] == "10<eos>"  # a prompt/response row: the response and the tokenizer's eos


def test_sft_rows_may_hold_conversations_instead_of_prompts(tmp_path):
    path = tmp_path / "sft.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path.write_text(json.dumps(chat) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="line 2: column 'messages' has no assistant turn"):
        load_prompt_dataset(str(path), conversation_key="messages")
    path.write_text(json.dumps(chat) + "\n")
    assert load_prompt_dataset(str(path), conversation_key="messages")[0]["messages"][1]["content"] == "yo"
    with pytest.raises(ValueError, match="missing value for column 'prompt'"):
        load_prompt_dataset(str(path))  # without conversations (RL), a row needs its prompt


def test_config_takes_verl_spellings():
    config = load_config(
        "demo",
        ["data.train_files=/data/train.parquet", "data.val_files=/data/test.parquet", "data.truncation=left"],
    )
    assert config.data.train_files == ["/data/train.parquet"] and config.data.val_files == ["/data/test.parquet"]
    config = load_config("demo", ["custom_reward_function.path=my_reward.py"])
    assert config.reward.reward_fn.endswith("/my_reward.py:compute_score")
    with pytest.raises(ConfigError, match="custom_reward_function.path .* and reward.reward_fn .* both"):
        load_config("demo", ["custom_reward_function.path=my_reward.py", "reward.reward_fn=exact"])
    with pytest.raises(ConfigError, match="data.truncation"):
        load_config("demo", ["data.truncation=middle"])


def test_a_conversation_validates_on_its_last_question():
    conversation = [
        {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    row = conversation_as_prompt({"messages": conversation}, "prompt", "messages")
    assert row["prompt"] == conversation[:3] and row["ground_truth"] == "4"
    recorded = conversation_as_prompt({"messages": conversation, "ground_truth": "four"}, "prompt", "messages")
    assert recorded["ground_truth"] == "four"  # the row's own ground truth wins
    plain = {"prompt": "1+1=", "answer": "2"}
    assert conversation_as_prompt(plain, "prompt", "messages") is plain
