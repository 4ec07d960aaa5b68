"""Peak memory per worker of ``actor.strategy: fsdp2`` against ``ddp`` (docs/performance.md, FSDP2 vs DDP).

The model: a Llama with the tiny character tokenizer (``rlworkers.models.tiny.ensure_tiny_model``), built here with
random weights: ``--layers`` decoder layers of width ``--hidden`` (heads of 64), MLP width ``--intermediate``, tied
embeddings, float32; built once into ~/.cache/rlflow/bench/fsdp_memory/models/ (by a child process, so this one
stays small) and reused. The default, 12 layers of Llama-3.2-1B's width (2048, MLP 5632), has 0.62B parameters,
sized for 2 workers on a 24 GiB machine. Per worker, as measured at 50M and 100M parameters: DDP holds float32
weights, gradients, AdamW's two moments, DDP's gradient buckets and the reference, ~21 bytes a parameter in SFT and
~25 in GRPO, so two DDP workers of 0.62B need ~25 and ~29 GiB. FSDP2 holds a half of each in each worker, but
gathers the whole policy (4 bytes a parameter) to generate (validation; GRPO's rollout): ~14 bytes a parameter at
that peak, ~18 GiB for two workers of 0.62B; ``fsdp2-lockstep`` (``actor.fsdp_config.gather_for_generation=false``)
generates a layer at a time instead (~12 bytes a parameter at 50M). At 1.03B (``--layers 20``) rlflow refuses ddp
and fsdp2 before any worker starts on a 24 GiB machine (NotEnoughMemory, flows/controller/run_start.py); fsdp2-lockstep
trains SFT there, and GRPO with ``--override model.dtype=bfloat16 --override actor.optim.low_precision_weights=true``
(in float32 its second step, the first with AdamW's moments, is killed for memory: the docs' table). Those ~14 and
~12 need glibc's mmap threshold fixed, which rlflow now does for fsdp2 workers on the CPU
(``MALLOC_MMAP_THRESHOLD_=131072``, flows/controller/groups.py): without it the workers' heaps kept FSDP2's freed gather
buffers and their RSS grew step by step (to 20-33 bytes a parameter at 50M-100M).

Each run is the real CLI in a child process, as a user runs it, for each strategy of ``--strategies`` (``ddp``,
``fsdp2``, ``fsdp2-lockstep``: ``STRATEGIES`` below) and each flow of ``--flows`` (``grpo``: configs/demo.yaml,
``sft``: configs/demo-sft.yaml, on the built-in 2-digit sums)::

    .venv/bin/rlflow train <flow> --config demo[-sft] model.path=<model> actor.strategy=<ddp|fsdp2>
        trainer.n_workers=2 trainer.total_steps=<--steps> trainer.save_freq=<--steps> trainer.test_freq=0
        trainer.run_name=<unique> trainer.resume=never trainer.log_model=false trainer.max_restarts=0 ...

with small batches so that a step is short on a 2-core CPU (GRPO: 4 prompts x 2 samples, 4 new tokens; SFT: 4
rows; 2 sequences per forward/backward; 4 validation sums; ``OVERRIDES`` below). So a run loads the model into 2
Ray workers (with GRPO's reference beside the policy in each), validates
at its start and end, trains ``--steps`` steps, writes one checkpoint (fsdp2: each worker its shard of weights and
AdamW state) and the final model, and is tracked in MLflow. ``trainer.max_restarts=0``: a worker lost (an
out-of-memory kill) ends the run rather than restarting it from its checkpoint.

Measured per run, from this process: the peak RSS of each of the run's ``ray::ActorRolloutRefWorker`` processes
(the kernel's high-water mark ``VmHWM``, polled every 0.5 s with bench/vs_trl.py's ``RayWorkerPeaks``), the
machine's RAM in use at its fullest (MemTotal - the lowest MemAvailable seen: other work on the machine counts
too), the median of the steps' ``timing_s/step`` (from the run's "step k/N" log lines), the wall time of the child
process (spawn to exit: start-up, model loading, validation, checkpoint and final model included), the size of the
checkpoint it wrote, and how it ended: finished, refused before start (NotEnoughMemory), out of memory (its output
names a memory error or an out-of-memory kill), stalled (no new output for ``--stall-timeout`` seconds: killed,
with its Ray) or failed. The run folder is deleted after each run (a checkpoint with AdamW state is 12 bytes a
parameter). Printed: a markdown table, the machine (CPU, cores, RAM), the date, the commit and this command line,
and the last lines of every run that did not finish. Logs in ~/.cache/rlflow/bench/fsdp_memory/logs/.

Needs the Prefect and MLflow servers: uses those that PREFECT_API_URL and MLFLOW_TRACKING_URI name, else starts
them as ``rlflow demo`` does (``flows.ops.services.start_services``, in the repository root; reused if ``rlflow server
up`` already runs them) and, if it started them, stops them at the end. The machine should be otherwise idle.

``--model smollm2-135m-instruct`` (or any model folder) measures a real model instead, DDP and fsdp2 side by side,
on the jobs configs/real.yaml and configs/real-sft.yaml run (their batches: GRPO 8 prompts x 4 samples of 16
tokens, SFT 16 rows; 8 validation sums instead of 200).

    .venv/bin/python bench/fsdp_memory.py [--layers 12] [--hidden 2048] [--intermediate 5632] [--model M] [--steps 3]
        [--strategies fsdp2,ddp] [--flows grpo,sft] [--stall-timeout 600] [--override KEY=VALUE ...]
        [--env KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from vs_trl import RayWorkerPeaks  # bench/vs_trl.py: peak RSS of a Ray worker class below a process

CACHE = Path.home() / ".cache" / "rlflow" / "bench" / "fsdp_memory"
REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
GIB = 1024**3
PRESETS = {"grpo": "demo", "sft": "demo-sft"}
# --model: the real model's own presets (configs/real.yaml, real-sft.yaml: the jobs a user runs), their batch sizes
REAL_PRESETS = {"grpo": "real", "sft": "real-sft"}
# --strategies: a name -> its overrides (fsdp2-lockstep: HF generation gathers a layer at a time, never the whole)
STRATEGIES = {
    "ddp": ["actor.strategy=ddp"],
    "fsdp2": ["actor.strategy=fsdp2"],
    "fsdp2-lockstep": ["actor.strategy=fsdp2", "actor.fsdp_config.gather_for_generation=false"],
}
# small batches, so that a step of the default model is short on 2 CPU cores (per worker: 2 sequences a pass)
OVERRIDES = {
    "grpo": [
        "data.train_batch_size=4",
        "rollout.n=2",
        "rollout.response_length=4",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "rollout.log_prob_micro_batch_size_per_gpu=2",
        "data.task.num_val=4",
    ],
    "sft": [
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.steps_per_task=1",
        "data.task.num_val=4",
    ],
}
STEP_LINE = re.compile(r"step (\d+)/(\d+)\s.*?timing_s/step=([0-9.eE+-]+)")
# a run refused before any worker starts: its workers' state alone would not fit (flows/controller/run_start.py)
REFUSED = re.compile(r"NotEnoughMemory: (.*)")
# what a run that ran out of memory prints: Ray's memory monitor, a SIGKILLed worker, torch, Python
OUT_OF_MEMORY = re.compile(
    r"OutOfMemoryError|out of memory|running low on memory|MemoryError|\bOOM\b|SIGKILL|killed by the kernel",
    re.IGNORECASE,
)


# ---------------------------------------------------------------------------------------------- the model
def ensure_model(layers: int, hidden: int, intermediate: int) -> tuple[Path, int]:
    """The model folder (built once, in a child process: a 1B model is 4 GB of float32 to create and save) and its
    parameter count."""
    path = CACHE / "models" / f"llama-{layers}x{hidden}-mlp{intermediate}"
    if not (path / "model.safetensors").exists():
        print(f"building the model in {path} (once; reused later) ...", flush=True)
        build = (
            "from rlworkers.models.tiny import ensure_tiny_model; "
            f"ensure_tiny_model({str(path)!r}, num_layers={layers}, hidden_size={hidden}, "
            f"intermediate_size={intermediate})"
        )
        subprocess.run([PYTHON, "-c", build], check=True, cwd=REPO)
    return path, parameter_count(path)


def parameter_count(path: Path) -> int:
    """Parameters stored in ``path``'s safetensors (a tied head is stored once, as it is counted)."""
    from safetensors import safe_open

    with safe_open(Path(path) / "model.safetensors", "pt") as weights:
        count = 0
        for name in weights.keys():
            count += _numel(weights.get_slice(name).get_shape())
    return count


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


# ---------------------------------------------------------------------------------------------- services
def ensure_services() -> bool:
    """Point this process (and so the runs) at the servers: the environment's, else start (or reuse) the local ones
    as ``rlflow demo`` does. True if they were started here (and so are to be stopped at the end)."""
    from flows.ops.preflight import apply_service_env
    from flows.ops.services import ServiceConfig, service_status, start_services
    from flows.plumbing.servers import MLFLOW_TRACKING_URI, PREFECT_API_URL

    if os.environ.get(PREFECT_API_URL) and os.environ.get(MLFLOW_TRACKING_URI):
        return False
    running = all(s["healthy"] for s in service_status(ServiceConfig()).values())
    apply_service_env(start_services(ServiceConfig()))
    if not running:
        print("started the Prefect and MLflow servers; they are stopped again at the end", flush=True)
    return not running


# ---------------------------------------------------------------------------------------------- one run
class RunWatch(RayWorkerPeaks):
    """RayWorkerPeaks of the actor workers, and on each poll also every process of the run's tree (to kill whatever
    is left of it) and the machine's lowest MemAvailable."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, float] = {}  # pid -> create_time of every process ever below the run
        self.min_available = memory_available()

    def poll(self, root: int) -> None:
        try:
            for process in psutil.Process(root).children(recursive=True):
                self.seen.setdefault(process.pid, process.create_time())
        except psutil.Error:
            pass
        self.min_available = min(self.min_available, memory_available())
        super().poll(root)

    def kill_leftovers(self) -> int:
        """SIGKILL every process seen below the run that still runs (the same pid and start time); how many."""
        left = []
        for pid, created in self.seen.items():
            try:
                process = psutil.Process(pid)
                if process.create_time() == created:
                    process.kill()
                    left.append(process)
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=10)
        return len(left)


def memory_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_total() -> int:
    return psutil.virtual_memory().total


def run_once(flow: str, strategy: str, model: Path, args, tag: str) -> dict:
    """``rlflow train <flow>`` with ``strategy`` in a child process (its own process group, ``args.env`` added to
    its environment), watched until it exits or stalls; what it measured."""
    steps, stall_timeout = args.steps, args.stall_timeout
    run_name = f"bench-fsdp-memory-{flow}-{strategy}-{tag}"
    runs_dir = CACHE / "runs"
    log = CACHE / "logs" / f"{run_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    rlflow = Path(PYTHON).parent / "rlflow"
    command = [str(rlflow)] if rlflow.exists() else [PYTHON, "-m", "flows.ops.cli"]
    command += [
        "train",
        flow,
        "--config",
        (REAL_PRESETS if args.model else PRESETS)[flow],
        f"model.path={model}",
        *STRATEGIES[strategy],
        "trainer.n_workers=2",
        f"trainer.total_steps={steps}",
        f"trainer.save_freq={steps}",
        "trainer.test_freq=0",
        f"trainer.run_name={run_name}",
        "trainer.resume=never",
        f"trainer.runs_dir={runs_dir}",
        "trainer.log_model=false",
        "trainer.max_restarts=0",
        *(["data.task.num_val=8"] if args.model else OVERRIDES[flow]),
        *args.override,
    ]
    watch = RunWatch()
    stalled = False
    start = time.perf_counter()
    with open(log, "w") as out:
        env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}  # Ray's workers inherit it
        child = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        watch.start(child.pid)
        try:
            size, progressed = 0, time.monotonic()
            while child.poll() is None:
                time.sleep(1.0)
                if log.stat().st_size != size:
                    size, progressed = log.stat().st_size, time.monotonic()
                elif time.monotonic() - progressed > stall_timeout:
                    stalled = True
                    break
        finally:  # stalled, or this bench interrupted: the run's process group, then anything of it left
            watch.stop()
            if child.poll() is None:
                watch.poll(child.pid)  # a last look at its process tree, for kill_leftovers
                with contextlib.suppress(ProcessLookupError):  # the group may be gone already
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            watch.kill_leftovers()
    wall = time.perf_counter() - start
    text = log.read_text(errors="replace")
    step_times = [float(m.group(3)) for m in STEP_LINE.finditer(text)]
    checkpoint = runs_dir / run_name / "checkpoints" / f"step_{steps}"
    checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())  # 0 if none
    sharded = any(path.name == "shards" for path in checkpoint.rglob("*"))  # fsdp2: DCP folders of shards
    shutil.rmtree(runs_dir / run_name, ignore_errors=True)
    refused = REFUSED.search(text)
    if stalled:
        result = f"stalled (no output for {stall_timeout:.0f} s)"
    elif child.returncode == 0:
        result = "finished"
    elif refused:
        result = "refused before start (NotEnoughMemory)"
    elif OUT_OF_MEMORY.search(text) or child.returncode == -signal.SIGKILL:
        result = "out of memory"
    else:
        result = f"failed (exit code {child.returncode})"
    actor_peaks, other_peaks = watch.actor_peaks()
    return {
        "flow": flow,
        "strategy": strategy,
        "result": result,
        "steps_done": len(step_times),
        "peaks_gib": [p / 1024 for p in actor_peaks + other_peaks],  # MiB -> GiB
        "median_step": statistics.median(step_times) if step_times else None,
        "wall": wall,
        "machine_peak_gib": (memory_total() - watch.min_available) / GIB,
        "checkpoint_gib": checkpoint_bytes / GIB,
        "sharded": sharded,
        "command": command,
        "log": log,
        "cause": refused.group(1)
        if refused
        else next((ln for ln in text.splitlines() if OUT_OF_MEMORY.search(ln)), None),
        "tail": text.splitlines()[-20:],
    }


# ---------------------------------------------------------------------------------------------- the report
def machine() -> str:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, {memory_total() / GIB:.1f} GiB RAM"


def commit() -> str:
    found = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def print_report(args, params: int, results: list[dict], started: datetime.datetime) -> None:
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"
    state, reference = 16 * params / GIB, 4 * params / GIB  # float32 weights, gradients, AdamW's moments; reference
    if args.model:
        model = f"{args.model}: {params:,} parameters."
        batches = "the presets' batches (GRPO 8 prompts x 4 samples, SFT 16 rows a step)"
    else:
        model = (
            f"Llama, {args.layers} layers x hidden {args.hidden} (MLP {args.intermediate}, heads of 64), character "
            f"tokenizer, tied embeddings, float32: {params:,} parameters."
        )
        batches = "GRPO 4 prompts x 2 samples, SFT 4 rows a step"
    lines = [
        model,
        f"Per worker, the state alone: DDP {state:.2f} GiB (float32 weights, gradients, AdamW's moments; GRPO "
        f"+{reference:.2f} GiB reference), FSDP2 over 2 workers half of it, plus {reference:.2f} GiB while it "
        "generates (the whole policy gathered).",
        f"{args.steps} steps, 2 workers, one checkpoint; {batches}. A run: {shlex.join(results[0]['command'])}",
    ]
    if args.env:
        lines.append(f"extra environment of the runs: {' '.join(args.env)}")
    if args.override:
        lines.append(f"extra overrides of the runs: {' '.join(args.override)}")
    print("\n" + "\n".join(lines) + "\n")
    print(
        "| model | flow | strategy | result | peak RSS per worker (GiB) | median step (s) | wall time (s) | "
        "machine RAM in use at peak (GiB) | checkpoint (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        peaks = " / ".join(f"{p:.2f}" for p in r["peaks_gib"]) or "-"
        step = f"{r['median_step']:.1f}" if r["median_step"] is not None else "-"
        ended_early = r["result"] not in ("finished", "refused before start (NotEnoughMemory)")
        steps_done = f" after {r['steps_done']}/{args.steps} steps" if ended_early else ""
        print(
            f"| {size} | {r['flow']} | {r['strategy']} | {r['result']}{steps_done} | {peaks} | {step} | "
            f"{r['wall']:.0f} | {r['machine_peak_gib']:.1f} | {r['checkpoint_gib']:.2f}"
            f"{' sharded' if r['sharded'] else ''} |"
        )
    print(
        f"\nmachine: {machine()}; date: {started:%Y-%m-%d %H:%M}; rlflow {commit()}\n"
        f"command: {' '.join(shlex.quote(a) for a in [os.path.relpath(PYTHON, REPO), *sys.argv])}\n"
        "peak RSS: VmHWM of each ray::ActorRolloutRefWorker process (the policy and the reference in each), polled "
        "every 0.5 s; machine RAM in use: MemTotal - lowest MemAvailable during the run (other work included); "
        "median step: timing_s/step of the steps; wall time: the `rlflow train` process, start to exit"
    )
    for r in results:
        if r["result"] != "finished":
            if r["result"].startswith("refused"):
                print(f"\n{r['flow']} {r['strategy']}: refused before any worker started: {r['cause']}")
                continue
            print(f"\n{r['flow']} {r['strategy']}: {r['result']}; the end of its output ({r['log']}):")
            if r["cause"]:
                print(f"    [first line naming memory] {r['cause'][:400]}\n    [...]")
            print("    " + "\n    ".join(r["tail"]))


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (default 12)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size, a multiple of 64 (default 2048)")
    parser.add_argument("--intermediate", type=int, default=5632, help="MLP width (default 5632)")
    parser.add_argument(
        "--model",
        default=None,
        help="a model path or name (e.g. smollm2-135m-instruct) instead of the Llama built from --layers/--hidden",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument(
        "--strategies", default="fsdp2,ddp", help=f"comma-separated, of {', '.join(STRATEGIES)} (default fsdp2,ddp)"
    )
    parser.add_argument("--flows", default="grpo,sft", help="comma-separated flows: grpo, sft")
    parser.add_argument(
        "--stall-timeout", type=float, default=600, help="kill a run with no new output for this many seconds"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override added to every run (repeatable), e.g. actor.fsdp_config.reshard_after_forward=false",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the runs and their Ray workers (repeatable), e.g. "
        "MALLOC_MMAP_THRESHOLD_=131072",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a killed bench still cleans up
    strategies, flows = args.strategies.split(","), args.flows.split(",")
    for item in args.env:
        if "=" not in item:
            parser.error(f"--env {item!r}: write KEY=VALUE")
    for flow in flows:
        if flow not in PRESETS:
            parser.error(f"--flows: {flow!r} is not one of {sorted(PRESETS)}")
    for strategy in strategies:
        if strategy not in STRATEGIES:
            parser.error(f"--strategies: {strategy!r} is not one of {list(STRATEGIES)}")

    os.chdir(REPO)  # the servers' state (.rlflow/) and the runs' relative paths, as `rlflow server up` has them
    started = datetime.datetime.now()
    if args.model:
        from rlworkers.models.loading import resolve_model_path

        model = Path(resolve_model_path(args.model))
        params = parameter_count(model)
    else:
        model, params = ensure_model(args.layers, args.hidden, args.intermediate)
    print(f"model {model}: {params:,} parameters", flush=True)
    started_services = ensure_services()
    results = []
    tag = started.strftime("%Y%m%d-%H%M%S")
    try:
        for flow in flows:
            for strategy in strategies:
                print(f"{flow} {strategy} ...", end=" ", flush=True)
                results.append(run_once(flow, strategy, model, args, tag))
                print(f"{results[-1]['result']}, {results[-1]['wall']:.0f} s", flush=True)
    finally:
        if started_services:
            from flows.ops.services import ServiceConfig, stop_services

            stop_services(ServiceConfig())
    print_report(args, params, results, started)


if __name__ == "__main__":
    main()
