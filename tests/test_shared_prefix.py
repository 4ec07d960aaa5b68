"""A prompt prefix every row shares (a system prompt, an agent's tool descriptions) is computed once in the log-prob
and update forwards (``rlworkers.workers.common.response_logits``: one sequence of the prefix and every row's rest),
with the logits and the gradients of computing it in every row, under gradient checkpointing and DDP too (FSDP2:
tests/test_real_model_training.py's FSDP2 = DDP run, whose chat prompts share their system prompt)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoConfig, AutoModelForCausalLM

from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.workers import common

PREFIX = [5, 9, 14, 20, 7, 33, 41, 12, 8, 60, 61, 62, 17, 18, 19, 22, 23, 24, 25, 26]  # 20 tokens
TAILS = [[30, 31, 32], [40], [50, 51, 52, 53, 54]]  # each row's own end of prompt, first tokens all different
RESPONSES = [[70, 71, 72, 2], [73, 74, 2, 0], [75, 76, 77, 78]]  # the second ends early: right padding


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


def rollout(prompts: list[list[int]], responses: list[list[int]] = RESPONSES) -> TensorDict:
    """Prompts left-padded (pad 0), responses right-padded, as a rollout hands them to the actor."""
    width = max(map(len, prompts))
    ids = [[0] * (width - len(p)) + p + r for p, r in zip(prompts, responses)]
    mask = [[0] * (width - len(p)) + [1] * len(p) + [int(t != 0) for t in r] for p, r in zip(prompts, responses)]
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "responses": torch.tensor(responses),
        },
        batch_size=[len(prompts)],
    )


def shared_prefix(batch: TensorDict) -> int:
    prompt_length = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    return common.shared_prompt_prefix(batch["input_ids"], batch["attention_mask"], prompt_length)


def test_the_shared_prefix_is_the_prompts_common_start_leaving_each_row_a_token_of_its_own():
    assert shared_prefix(rollout([PREFIX + tail for tail in TAILS])) == 20
    assert shared_prefix(rollout([PREFIX[:6] + tail for tail in TAILS])) == 6
    # the same prompt in every row: all but its last token, whose logits predict the first response token
    assert shared_prefix(rollout([PREFIX] * 3)) == 19
    assert shared_prefix(rollout([PREFIX + TAILS[0]], RESPONSES[:1])) == 0  # one row: nothing shared
    inside = rollout([PREFIX + tail for tail in TAILS])
    inside["attention_mask"][0, -6] = 0  # a padding token inside a prompt: not the left-padded layout
    assert shared_prefix(inside) == 0


def embedded_shapes(model) -> list[tuple[int, int]]:
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    return seen


def logits_and_gradients(model, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    logits = common.response_logits(model, batch, temperature=0.7)
    mask = (batch["responses"] != 0).float()
    (common.logprobs_from_logits(logits, batch["responses"]) * mask).sum().backward()
    return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_a_shared_prefix_is_computed_once_with_the_logits_and_gradients_of_every_row_computing_it(
    tiny_path, monkeypatch
):
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    batch = rollout([PREFIX + tail for tail in TAILS])
    seen = embedded_shapes(model)
    shared = logits_and_gradients(model, batch)
    width = batch["input_ids"].shape[1]
    assert seen == [(1, 20 + 3 * (width - 20))]  # one sequence: the prefix once, then each row without it
    monkeypatch.setattr(common, "MIN_SHARED_PREFIX", 10**6)  # every row computes its own prefix, as before
    seen.clear()
    each = logits_and_gradients(model, batch)
    assert seen == [(3, width)]
    response = (batch["responses"] != 0).unsqueeze(-1).expand_as(shared[0])
    torch.testing.assert_close(shared[0][response], each[0][response], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1], each[1], rtol=1e-3, atol=1e-5)
    assert each[1].abs().sum() > 0


def test_under_gradient_checkpointing_the_shared_prefix_gives_the_same_gradients(tiny_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = rollout([PREFIX + tail for tail in TAILS])
    seen = embedded_shapes(model)
    shared = logits_and_gradients(model, batch)
    assert seen[0] == (1, 20 + 3 * (batch["input_ids"].shape[1] - 20))
    monkeypatch.setattr(common, "MIN_SHARED_PREFIX", 10**6)
    each = logits_and_gradients(model, batch)
    torch.testing.assert_close(shared[1], each[1], rtol=1e-3, atol=1e-5)


def test_sharing_is_left_out_where_the_one_sequence_would_cost_more():
    """The sequence of the prefix and every row's rest has fewer tokens, but its attention spans all of it."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=2,
                                                                  num_hidden_layers=1, intermediate_size=64,
                                                                  attn_implementation="sdpa"))  # fmt: skip
    assert common._sharing_pays(model, torch.Size([4, 300]), 200)
    assert not common._sharing_pays(model, torch.Size([64, 2000]), 100)  # long rows, a short prefix
    model.config._attn_implementation = "eager"  # adds a float mask: the boolean one would be wrong there
    assert not common._sharing_pays(model, torch.Size([4, 300]), 200)


def _ddp_gradients_on_rank(rank: int, init_file: str, tiny_path: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(AutoModelForCausalLM.from_pretrained(tiny_path))
    prompts = [PREFIX + tail for tail in TAILS + [[44, 45]]]
    batch = rollout(prompts[2 * rank : 2 * rank + 2], (RESPONSES + [[79, 2, 0, 0]])[2 * rank : 2 * rank + 2])
    seen = embedded_shapes(model.module)
    _, gradients = logits_and_gradients(model, batch)
    results[rank] = (gradients, seen, batch["input_ids"].shape[1])
    dist.destroy_process_group()


def test_under_ddp_the_shared_prefix_gradient_is_reduced_like_the_rest(tiny_path, tmp_path):
    """Two ranks of DDP, each with two rows and the prefix computed once: their reduced gradient is the mean of the
    two ranks' gradients computed in one process with every row computing its prefix."""
    context = torch.multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        procs = [
            context.Process(target=_ddp_gradients_on_rank, args=(rank, str(tmp_path / "init"), tiny_path, results))
            for rank in range(2)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=180)
        assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
        results = dict(results)
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    prompts, responses = [PREFIX + tail for tail in TAILS + [[44, 45]]], RESPONSES + [[79, 2, 0, 0]]
    common.MIN_SHARED_PREFIX, minimum = 10**6, common.MIN_SHARED_PREFIX
    try:
        halves = [logits_and_gradients(model, rollout(prompts[i : i + 2], responses[i : i + 2]))[1] for i in (0, 2)]
    finally:
        common.MIN_SHARED_PREFIX = minimum
    expected = (halves[0] + halves[1]) / 2
    for rank in (0, 1):
        gradients, seen, width = results[rank]
        assert seen == [(1, 20 + 2 * (width - 20))]  # one sequence: the prefix computed once on this rank
        torch.testing.assert_close(gradients, expected, rtol=1e-3, atol=1e-5)


def test_generation_computes_a_shared_prefix_once_and_samples_what_every_row_computing_it_samples(
    tiny_path, monkeypatch
):
    """HF generate continues every row from the prefix's keys and values, computed once (a turn of a multi-turn
    trajectory re-reads its whole context, tool descriptions first, every turn)."""
    from rlworkers.models.loading import load_tokenizer
    from rlworkers.workers.config import RolloutConfig
    from rlworkers.workers.rollout import SamplingRequest
    from rlworkers.workers.rollout.hf_rollout import HFRollout

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    rollout_ = HFRollout(model, load_tokenizer(tiny_path), RolloutConfig())
    contexts = [PREFIX + tail for tail in TAILS]
    request = SamplingRequest(prompts=None, do_sample=False, temperature=1.0, response_length=6)
    seen = embedded_shapes(model)
    shared = rollout_.generate_turns(contexts, [6, 6, 6], request)
    width = max(map(len, contexts))
    assert seen[:2] == [(1, 20), (3, width - 20)]  # the prefix once, then every row's rest from its keys and values
    monkeypatch.setattr(common, "MIN_SHARED_PREFIX", 10**6)
    seen.clear()
    each = rollout_.generate_turns(contexts, [6, 6, 6], request)
    assert seen[0] == (3, width)
    assert [turn.token_ids for turn in shared] == [turn.token_ids for turn in each]
    for one, other in zip(shared, each):
        torch.testing.assert_close(torch.tensor(one.log_probs), torch.tensor(other.log_probs), rtol=0, atol=1e-4)


def test_an_sft_step_computes_a_shared_prefix_once_and_learns_what_every_row_computing_it_learns(
    tiny_path, monkeypatch
):
    """SFT rows (prompt, then the response it learns) that start alike: the loss, and the weights after the step,
    those of computing the prefix in every row."""
    from rlworkers.protocol import DataProto
    from rlworkers.workers.actor_rollout_ref import ActorRolloutRefWorker
    from rlworkers.workers.config import WorkerConfig

    batch = rollout([PREFIX + tail for tail in TAILS])
    prompt_length = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    loss_mask = batch["attention_mask"].clone()
    loss_mask[:, :prompt_length] = 0
    data = DataProto.from_dict({**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")},
                                "loss_mask": loss_mask})  # fmt: skip
    config = {"model": {"path": tiny_path}, "actor": {"ppo_mini_batch_size": 3, "ppo_micro_batch_size_per_gpu": 3}}
    results = []
    for minimum in (common.MIN_SHARED_PREFIX, 10**6):
        monkeypatch.setattr(common, "MIN_SHARED_PREFIX", minimum)
        worker = ActorRolloutRefWorker(WorkerConfig.model_validate(config), role="actor")
        worker.init_model()
        seen = embedded_shapes(worker.model)
        loss = worker.sft_step(data).meta_info["metrics"]["sft/loss"]
        results.append((loss, seen, torch.cat([p.detach().flatten() for p in worker.model.parameters()])))
    (shared_loss, shared_seen, shared_weights), (each_loss, each_seen, each_weights) = results
    width = batch["input_ids"].shape[1]
    assert shared_seen == [(1, 20 + 3 * (width - 20))] and each_seen == [(3, width)]
    assert shared_loss == pytest.approx(each_loss, rel=1e-5)
    torch.testing.assert_close(shared_weights, each_weights, rtol=1e-3, atol=1e-5)  # Adam: a step of ~lr each


def test_a_lora_adapter_sees_the_shared_prefix_computed_once_with_the_same_logits_and_gradients(tiny_path, monkeypatch):
    """Under peft's wrapper (``actor.lora``) the one sequence, its block mask and the positions to keep reach the
    base model: the adapter's logits and its gradients are those of every row computing the prefix."""
    from rlworkers.models import lora

    torch.manual_seed(0)
    adapter = lora.lora_config(4, 8.0, 0.0, "all-linear")
    model = lora.attach_adapter(AutoModelForCausalLM.from_pretrained(tiny_path), adapter)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapter would change nothing
                param.normal_(0, 0.05)
    batch = rollout([PREFIX + tail for tail in TAILS])
    seen = embedded_shapes(model.get_base_model())

    def adapter_logits_and_gradients():
        model.zero_grad()
        logits = common.response_logits(model, batch, temperature=0.7)
        mask = (batch["responses"] != 0).float()
        (common.logprobs_from_logits(logits, batch["responses"]) * mask).sum().backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.requires_grad]
        return logits.detach(), torch.cat(grads)

    shared = adapter_logits_and_gradients()
    width = batch["input_ids"].shape[1]
    assert seen == [(1, 20 + 3 * (width - 20))]
    monkeypatch.setattr(common, "MIN_SHARED_PREFIX", 10**6)
    seen.clear()
    each = adapter_logits_and_gradients()
    assert seen == [(3, width)]
    response = (batch["responses"] != 0).unsqueeze(-1).expand_as(shared[0])
    torch.testing.assert_close(shared[0][response], each[0][response], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1], each[1], rtol=1e-3, atol=1e-5)
    assert each[1].abs().sum() > 0


def test_the_critic_computes_a_shared_prefix_once_with_the_values_and_the_update_of_every_row_computing_it(
    tiny_path, monkeypatch
):
    """PPO's value model (a one-output token head, whose forward takes no ``logits_to_keep``): its values, and its
    weights after an update, those of computing the prefix in every row."""
    from rlworkers.protocol import DataProto
    from rlworkers.workers.critic import CriticWorker

    batch = rollout([PREFIX + tail for tail in TAILS])
    response_mask = (batch["responses"] != 0).long()
    data = DataProto.from_dict({**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")},
                                "response_mask": response_mask})  # fmt: skip
    config = {"ppo_mini_batch_size": 3, "ppo_micro_batch_size_per_gpu": 3}
    results = []
    for minimum in (common.MIN_SHARED_PREFIX, 10**6):
        monkeypatch.setattr(common, "MIN_SHARED_PREFIX", minimum)
        critic = CriticWorker(config, {"path": tiny_path})
        critic.init_model()
        for module in critic.model.modules():
            if isinstance(module, torch.nn.Dropout):  # the token head's dropout would draw other masks for the shapes
                module.p = 0.0
        seen = embedded_shapes(critic.model)
        values = critic.compute_values(data).batch["values"]
        data.batch["values"], data.batch["returns"] = values, values + torch.linspace(-1, 1, values.shape[1])
        loss = critic.update_critic(data).meta_info["metrics"]["critic/vf_loss"]
        results.append((values, loss, seen, torch.cat([p.detach().flatten() for p in critic.model.parameters()])))
    (shared_values, shared_loss, shared_seen, shared_weights), (each_values, each_loss, each_seen, each_weights) = (
        results
    )
    width = batch["input_ids"].shape[1]
    assert shared_seen == [(1, 20 + 3 * (width - 20))] * 2 and each_seen == [(3, width)] * 2  # values, then update
    assert each_values.abs().sum() > 0 and (each_values[response_mask == 0] == 0).all()
    torch.testing.assert_close(shared_values, each_values, rtol=0, atol=1e-5)
    assert shared_loss == pytest.approx(each_loss, rel=1e-5)
    torch.testing.assert_close(shared_weights, each_weights, rtol=1e-3, atol=1e-5)
