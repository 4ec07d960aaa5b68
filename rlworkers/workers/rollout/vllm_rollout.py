"""Rollout with a vLLM engine colocated with the actor in the same worker process (``rollout.name: vllm``).

Returns the same DataProto as ``HFRollout`` (see ``rlworkers.workers.rollout``): ``prompts``, ``responses``
(right-padded), ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask`` (1 up to and including
the token that ended the response: EOS, a stop token or the last token of a stop string) and
``rollout_log_probs``, with ``n`` samples per prompt interleaved (a a b b) and the non-tensor columns carried.
``meta_info`` may override ``do_sample``, ``temperature``, ``n``, ``response_length`` (as for HF) and ``stop``
(a list of strings; vLLM only); with ``seed`` (a seeded evaluation) request i samples with seed ``seed + i``.
Greedy (``do_sample=False``) is vLLM's temperature 0.

Log-probs. vLLM returns raw-model log-probs by default (``logprobs_mode="raw_logprobs"``: before temperature).
The engine is created with ``logprobs_mode="processed_logprobs"``, so ``SamplingParams(logprobs=0)`` gives the
sampled token's log-prob under ``softmax(logits / temperature)`` — what the actor recomputes in
``compute_log_prob`` (and what HF's backend returns). In greedy mode they are taken at temperature 1, as HF does.
With top-k / top-p active, vLLM's processed log-probs are those of the truncated, renormalised distribution it
sampled from (``log p_T(token) - log(kept mass)``, so slightly higher than HF's and the actor's, which ignore the
truncation); with the RL defaults (``top_p=1, top_k=0``) the three agree to float precision.

The engine. Created lazily, in the process that owns the actor (the Ray worker), on the first
``generate_sequences``: ``vllm.LLM`` with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
uni-process executor, as verl's colocated rollout did), the actor's dtype, ``load_format="dummy"`` (nothing is read
from disk: the actor's weights are loaded into it at once), ``max_model_len`` = prompt width of the first batch +
response length (at least ``MIN_MAX_MODEL_LEN``, at most the model's ``max_position_embeddings``; a rollout
config attribute ``max_model_len`` overrides it), ``seed`` drawn from torch's RNG (the worker seeds it per rank,
so runs repeat and data-parallel ranks sample differently), ``generation_config="vllm"`` (sampling settings are
rlflow's, not the model folder's; a response stops at the tokenizer's EOS and at every id of the model's
``generation_config.eos_token_id``, passed as ``stop_token_ids``, as in HF's backend). On CPU:
``enforce_eager=True`` and a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 1 here). On CUDA: CUDA graphs
and sleep mode (below).
vLLM's CPU worker sets torch's intra-op threads to 1 and disables ``torch.set_num_threads`` for its own process;
here that process is the actor's, so both are restored after the engine starts. It also reseeds the process's
global RNGs with the engine seed (deterministic, as that seed is) and takes the objects then alive out of the
garbage collector's scans (``gc.freeze``). With several data-parallel workers each rank has its own engine
(tensor parallel 1); vLLM builds its groups over the actor's process group (verl's "external DP"), so the ranks
create their engines together — they do, as ``generate_sequences`` is dispatched to all of them.

Weight sync (``sync_weights(model)``, called by the worker after every actor update and checkpoint load). The
actor's ``state_dict()`` is handed, tensor by tensor and in memory, to vLLM's in-place reload
(``llm.collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``): with the engine in
this process the RPC is a direct call (no serialisation, no disk, no engine restart). vLLM maps HF names to its
fused layers (qkv_proj, gate_up_proj) and re-runs each layer's post-load processing — on CPU that re-packs the
linear weights for oneDNN, which a plain ``model.load_weights`` would leave stale. The prefix cache is then reset
(its KV blocks were computed with the old weights). Cost: one copy of the weights plus the re-pack, layer by
layer (transient memory about one layer); bench/rollout.py prints its time (docs/performance.md has figures). A
checkpoint round trip instead would cost a save, a load and an engine restart (seconds).

Sleep mode (CUDA only; vLLM's CPU worker ignores it). The engine is created with ``enable_sleep_mode=True``;
after each ``generate_sequences`` it sleeps at level 1 (KV cache freed, weights offloaded to host memory) so the
actor can train in the GPU memory it frees; ``sync_weights`` wakes the weights and reloads them; the next
``generate_sequences`` wakes the KV cache. Level 2 (weights discarded) would save the offload copy but also
drops buffers that are not in the checkpoint (the rotary cos/sin cache), which the reload does not restore.
A rollout config attribute ``free_cache_engine=False`` keeps the engine awake.

Rollout config attributes read when present (``RolloutConfig`` fields or defaults below):
``gpu_memory_utilization`` (0.5: the share of GPU memory vLLM may take beside the actor; on CPU the KV cache size
comes from ``VLLM_CPU_KVCACHE_SPACE``), ``enforce_eager`` (default: True on CPU, False on CUDA),
``free_cache_engine`` (True), ``max_model_len`` (None: derived as above), ``stop`` (None).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from vllm import LLM, SamplingParams  # at import: build_rollout turns a missing vLLM into an install hint

from rlworkers.models.lora import merged_weights
from rlworkers.protocol import DataProto
from rlworkers.workers.config import RolloutConfig
from rlworkers.workers.fsdp import full_weights, is_sharded
from rlworkers.workers.rollout import SamplingRequest, TurnOutput, rollout_output, sampling_request, stop_token_ids

logger = logging.getLogger(__name__)

DEFAULT_CPU_KVCACHE_GIB = "1"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
MIN_MAX_MODEL_LEN = 1024
SLEEP_LEVEL = 1  # see the module docstring: level 2 loses the rotary cache


class _RotaryReloadFilter(logging.Filter):
    """Drop vLLM's per-reload warning that rotary-embedding layers 'failed to load weights': they hold only a
    computed cos/sin cache (no checkpoint weights), which vLLM puts back untouched. Other layers still warn."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            record.getMessage().endswith("Failed to load weights") and args and str(args[0]).endswith("RotaryEmbedding")
        )


class VLLMRollout:
    def __init__(self, model, tokenizer, config: RolloutConfig, model_path: str):
        self.model, self.tokenizer, self.config, self.model_path = model, tokenizer, config, model_path
        self.device = next(model.parameters()).device
        self.on_cuda = self.device.type == "cuda"
        self.sleep_enabled = self.on_cuda and bool(self._option("free_cache_engine", True))
        self.llm = None
        self.max_model_len = None
        self._weights_asleep = self._kv_asleep = False

    def _option(self, name: str, default):
        value = getattr(self.config, name, None)
        return default if value is None else value

    # ------------------------------------------------------------------------------------------------ engine
    def _engine(self, prompt_width: int, response_length: int):
        if self.llm is None:
            self._create_engine(prompt_width, response_length)
        if prompt_width + response_length > self.max_model_len:
            raise ValueError(
                f"prompt width {prompt_width} + response_length {response_length} exceeds the vLLM engine's "
                f"max_model_len {self.max_model_len} (fixed when the engine started, from its first batch); set "
                "rollout.max_model_len to the longest prompt + response you will generate"
            )
        if self._kv_asleep or self._weights_asleep:
            self.llm.wake_up(tags=["weights", "kv_cache"] if self._weights_asleep else ["kv_cache"])
            self._kv_asleep = self._weights_asleep = False
        return self.llm

    def _create_engine(self, prompt_width: int, response_length: int) -> None:
        # The engine core runs in this process so that weight sync is a direct call on the model (see docstring).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
        limit = getattr(self.model.config, "max_position_embeddings", None) or 10**9
        self.max_model_len = int(
            self._option("max_model_len", min(limit, max(prompt_width + response_length, MIN_MAX_MODEL_LEN)))
        )
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = LLM(
                model=self.model_path,
                tokenizer=self.model_path,
                dtype=dtype,
                seed=seed,
                max_model_len=self.max_model_len,
                load_format="dummy",
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
                enforce_eager=bool(self._option("enforce_eager", not self.on_cuda)),
                gpu_memory_utilization=float(self._option("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)),
                enable_sleep_mode=self.sleep_enabled,
                tensor_parallel_size=1,
                distributed_executor_backend="uni",
            )
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it for its own process
            torch.set_num_threads(threads)
        reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if not any(isinstance(f, _RotaryReloadFilter) for f in reload_logger.filters):
            reload_logger.addFilter(_RotaryReloadFilter())
        logger.info(
            "vLLM engine started (%s, dtype %s, max_model_len %d, seed %d, sleep mode %s)",
            self.device,
            dtype,
            self.max_model_len,
            seed,
            self.sleep_enabled,
        )
        self._load_weights(self.model)

    # ------------------------------------------------------------------------------------------------ weights
    def sync_weights(self, model) -> None:
        """Load ``model``'s current weights into the engine in memory (before it exists: it loads them at start)."""
        self.model = model
        if self.llm is not None:
            if self._weights_asleep:
                self.llm.wake_up(tags=["weights"])
                self._weights_asleep = False
            self._load_weights(model)

    @torch.no_grad()
    def _load_weights(self, model) -> None:
        if is_sharded(model):  # fsdp2: each tensor gathered from its shards, handed over, dropped: no second copy
            weights = full_weights(model)
        else:
            weights = ((name, tensor.detach()) for name, tensor in merged_weights(model))  # LoRA: W + B @ A * scale
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------------------------------------ rollout
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        request = sampling_request(prompts, self.config)
        prompts = request.prompts
        input_ids, attention_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        stop = prompts.meta_info.get("stop", self._option("stop", None))
        llm = self._engine(input_ids.shape[1], request.response_length)
        outputs = self._generate(llm, contexts, [request.response_length] * len(contexts), request, stop)
        return rollout_output(prompts, *self._to_tensors(outputs, request.response_length))

    def generate_turns(
        self, contexts: list[list[int]], budgets: list[int], request: SamplingRequest
    ) -> list[TurnOutput]:
        """One turn for each multi-turn trajectory (``rollout.agent_loop``): each context its own request, with
        its own token budget. The engine's ``max_model_len`` must hold prompt + ``response_length``."""
        llm = self._engine(max(len(c) + b for c, b in zip(contexts, budgets)), 0)
        outputs = self._generate(llm, contexts, budgets, request, None)
        stops = set(stop_token_ids(self.tokenizer, self.model))
        turns = []
        for output, budget in zip(outputs, budgets):
            sample = output.outputs[0]
            tokens = list(sample.token_ids)[:budget]
            log_probs = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
            turns.append(TurnOutput(tokens, log_probs, stopped=bool(tokens) and tokens[-1] in stops))
        return turns

    def _generate(self, llm, contexts: list[list[int]], budgets: list[int], request: SamplingRequest, stop):
        do_sample = request.do_sample
        settings = dict(
            n=1,
            temperature=request.temperature if do_sample else 0.0,  # vLLM's greedy
            top_p=self.config.top_p if do_sample else 1.0,
            top_k=self.config.top_k if do_sample else 0,
            logprobs=0,
            stop=list(stop) if stop else None,
            stop_token_ids=stop_token_ids(self.tokenizer, self.model),
            detokenize=bool(stop),
        )
        seed = request.prompts.meta_info.get("seed")  # a seeded call (sampled evaluation): each request its own
        params = [  # generator
            SamplingParams(**settings, max_tokens=budget, seed=None if seed is None else int(seed) + i)
            for i, budget in enumerate(budgets)
        ]
        outputs = llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
        if self.sleep_enabled:
            llm.sleep(level=SLEEP_LEVEL)
            self._kv_asleep = self._weights_asleep = True
        return outputs

    def _to_tensors(self, outputs, response_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vLLM's outputs -> ``responses`` (pad after the end), ``response_mask``, ``rollout_log_probs``, ``[B, R]``.

        vLLM's ``token_ids`` end with the token that stopped the response (EOS, a stop token, the last token of a
        stop string), so the mask is 1 over exactly the returned tokens."""
        size = (len(outputs), response_length)
        responses = np.full(size, self.tokenizer.pad_token_id, dtype=np.int64)
        log_probs = np.zeros(size, dtype=np.float32)
        lengths = np.zeros(len(outputs), dtype=np.int64)
        for i, output in enumerate(outputs):
            sample = output.outputs[0]
            tokens = list(sample.token_ids)[:response_length]
            responses[i, : len(tokens)] = tokens
            log_probs[i, : len(tokens)] = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
            lengths[i] = len(tokens)
        response_mask = (np.arange(response_length)[None, :] < lengths[:, None]).astype(np.int64)
        return torch.from_numpy(responses), torch.from_numpy(response_mask), torch.from_numpy(log_probs)
