"""A reward model reads each row in its own vocabulary and chat template, on the run's device, with its settings.

The reward models here are built by hand so their scores are known: a one-layer Llama sequence classifier whose
layer adds nothing (its attention and MLP output projections are zero), whose token embeddings are one-hot and whose
score head holds one number per token id, so a row's score is the number of its last token. Its tokenizer is the
tiny model's character tokenizer with the characters in reverse order: the same text, other ids. Fed the policy's
ids (what the reward worker did before it decoded and re-tokenized), it reads other characters and scores them.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from flows.config import load_config
from flows.controller.groups import reward_worker_options
from rlworkers.data.batching import compute_position_id_with_mask, prompt_batch
from rlworkers.models.loading import load_tokenizer
from rlworkers.models.tiny import CHARACTERS, build_char_tokenizer, ensure_tiny_model
from rlworkers.protocol import DataProto
from rlworkers.workers.reward import RewardWorker

CHAT_TEMPLATE = "{% for m in messages %}#{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


def reward_tokenizer(chat_template: str | None = None):
    """The tiny character tokenizer with its characters reversed: every character has another id than the policy's
    (the special tokens keep theirs)."""
    tokenizer = build_char_tokenizer(characters=CHARACTERS[::-1])
    tokenizer.chat_template = chat_template
    return tokenizer


def save_reward_model(folder, tokenizer, values: dict[int, float]) -> str:
    """A sequence classifier whose score is ``values[id of the last token]`` (0 for an id not there), saved with
    ``tokenizer`` in ``folder``.

    Embedding ``i`` is the one-hot vector ``e_i`` (hidden size above the vocabulary's); the layer adds zero to the
    residual stream, so the final RMSNorm gives ``sqrt(hidden) * e_i`` at every position, and a score head of
    ``values[i] / sqrt(hidden)`` at ``i`` reads ``values[i]``."""
    hidden = 96
    assert len(tokenizer) <= hidden
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-9,
        num_labels=1,
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(len(tokenizer), hidden))
        model.score.weight.zero_()
        for token_id, value in values.items():
            model.score.weight[0, token_id] = value / math.sqrt(hidden)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


def generated_batch(rows: list[dict], policy, responses: list[list[int]]) -> DataProto:
    """``rows``' prompt batch with the given response ids (right-padded), as the policy's rollout returns it."""
    batch = prompt_batch(rows, policy)
    width = max(len(one) for one in responses)
    ids = torch.full((len(rows), width), policy.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, one in enumerate(responses):
        ids[row, : len(one)] = torch.tensor(one)
        mask[row, : len(one)] = 1
    attention_mask = torch.cat([batch.batch["attention_mask"], mask], dim=-1)
    batch.batch["prompts"] = batch.batch["input_ids"]
    batch.batch["responses"], batch.batch["response_mask"] = ids, mask
    batch.batch["input_ids"] = torch.cat([batch.batch["input_ids"], ids], dim=-1)
    batch.batch["attention_mask"] = attention_mask
    batch.batch["position_ids"] = compute_position_id_with_mask(attention_mask)
    return batch


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_reward_model_scores_its_own_tokens_of_the_response(policy_path, tmp_path):
    policy, rm_tokenizer = load_tokenizer(policy_path), reward_tokenizer()
    policy_id, rm_id = policy.convert_tokens_to_ids, rm_tokenizer.convert_tokens_to_ids
    # The reward model likes an answer ending in 7 and dislikes one ending in 3. The policy's ids of 7 and 3 are
    # other characters to it, scored the other way round.
    values = {rm_id("7"): 1.0, rm_id("3"): -1.0, policy_id("7"): -2.0, policy_id("3"): 2.0}
    assert len(values) == 4  # four different ids
    path = save_reward_model(tmp_path / "rm", rm_tokenizer, values)
    rows = [{"prompt": "9+8=", "answer": "17"}] * 2
    # A: "17" and the eos; B: "113", cut by the response length (no eos): texts of different lengths
    batch = generated_batch(rows, policy, [ids(policy, "17") + [policy.eos_token_id], ids(policy, "113")])

    worker = RewardWorker({"reward_model": {"path": path}}, tokenizer_path=policy_path)
    worker.init_model()
    scored = worker.compute_rm_score(batch)

    assert list(scored.non_tensor_batch["score"]) == pytest.approx([1.0, -1.0], abs=1e-4)  # A above B
    token_level = scored.batch["token_level_scores"]
    assert token_level.shape == (2, 3)
    assert token_level[:, 2].tolist() == pytest.approx([1.0, -1.0], abs=1e-4)  # the policy's last response token
    assert (token_level[:, :2] == 0).all()
    # What the worker did before (the policy's ids into the reward model): it reads A's eos and B's "3" as the
    # policy numbers them, and ranks B above A.
    with torch.no_grad():
        on_policy_ids = worker.reward_model.model(
            input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"]
        ).logits[:, 0]
    assert on_policy_ids.tolist() == pytest.approx([0.0, 2.0], abs=1e-4)


def test_a_chat_reward_model_gets_the_conversation_in_its_own_template(policy_path, tmp_path):
    policy, rm_tokenizer = load_tokenizer(policy_path), reward_tokenizer(CHAT_TEMPLATE)
    policy.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} {% endif %}"
    )
    rm_id = rm_tokenizer.convert_tokens_to_ids
    path = save_reward_model(tmp_path / "rm", rm_tokenizer, {rm_id("\n"): 0.5, rm_id("7"): 1.0})
    messages = [{"role": "user", "content": "What is 9+8?"}]
    rows = [{"prompt": messages}, {"prompt": "9+8="}]  # chat messages, and a plain string prompt
    batch = generated_batch(rows, policy, [ids(policy, "17") + [policy.eos_token_id]] * 2)
    assert list(batch.non_tensor_batch["raw_prompt"]) == ["What is 9+8? ", "9+8="]  # the policy's rendering

    worker = RewardWorker({"reward_model": {"path": path}}, tokenizer_path=policy_path)
    worker.init_model()
    seen = {}
    worker.reward_model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True
    )
    scored = worker.compute_rm_score(batch)

    # scored on each text's last token: the template's closing newline, the plain answer's 7
    assert list(scored.non_tensor_batch["score"]) == pytest.approx([0.5, 1.0], abs=1e-4)
    # what the model got: the conversation in the reward model's template (no BOS added: the template writes what
    # it wants), the plain prompt and response with the reward model's BOS
    conversation = "#user: What is 9+8?\n#assistant: 17\n"
    expected = [ids(rm_tokenizer, conversation), rm_tokenizer("9+8=17")["input_ids"]]
    got = [row[mask.bool()].tolist() for row, mask in zip(seen["input_ids"], seen["attention_mask"])]
    assert got == expected and expected[1][0] == rm_tokenizer.bos_token_id
    conversation_messages = [*messages, {"role": "assistant", "content": "17"}]
    assert rm_tokenizer.apply_chat_template(conversation_messages, tokenize=False) == conversation
    assert worker.reward_model.texts(batch, worker.tokenizer, "prompt") == ([conversation, "9+8=17"], [True, False])


def test_the_reward_model_runs_in_its_dtype_and_autocast(policy_path, tmp_path):
    rm_tokenizer = reward_tokenizer()
    path = save_reward_model(tmp_path / "rm", rm_tokenizer, {rm_tokenizer.convert_tokens_to_ids("7"): 1.0})
    policy = load_tokenizer(policy_path)
    batch = generated_batch([{"prompt": "9+8="}], policy, [ids(policy, "17")])

    bf16 = RewardWorker({"reward_model": {"path": path, "dtype": "bfloat16"}}, tokenizer_path=policy_path)
    bf16.init_model()
    assert bf16.reward_model.model.dtype == torch.bfloat16
    assert list(bf16.compute_rm_score(batch).non_tensor_batch["score"]) == pytest.approx([1.0], abs=1e-2)

    mixed = RewardWorker({"reward_model": {"path": path, "autocast": "bfloat16"}}, tokenizer_path=policy_path)
    mixed.init_model()
    head_dtypes = []
    mixed.reward_model.model.score.register_forward_hook(lambda module, args, out: head_dtypes.append(out.dtype))
    assert list(mixed.compute_rm_score(batch).non_tensor_batch["score"]) == pytest.approx([1.0], abs=1e-2)
    assert mixed.reward_model.model.dtype == torch.float32 and head_dtypes == [torch.bfloat16]


def test_a_reward_model_runs_on_the_runs_device_and_a_rule_on_cpu():
    model = ["reward.reward_model.path=tiny"]
    on_gpu = reward_worker_options(load_config("demo", ["trainer.device=cuda", *model]), "/policy")
    assert (on_gpu["use_gpu"], on_gpu["device"], on_gpu["tokenizer_path"]) == (True, "cuda", "/policy")
    assert on_gpu["prompt_key"] == "prompt"
    on_cpu = reward_worker_options(load_config("demo", [*model, "data.prompt_key=question"]), "/policy")
    assert (on_cpu["use_gpu"], on_cpu["device"], on_cpu["prompt_key"]) == (False, "cpu", "question")
    rule = reward_worker_options(load_config("demo", ["trainer.device=cuda", "reward.num_workers=1"]), "/policy")
    assert (rule["use_gpu"], rule["device"]) == (False, "cpu")
