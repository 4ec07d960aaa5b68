"""How much the tiny model's SFT warm-up depends on its seed: `rlflow train sft --config demo-sft` (the first half of
`make demo`, and the start model of tests/test_promotion.py's lineages and test_training's GRPO) once per seed, on one
worker as the tests' warm-up runs, with its validation (exact match on the task's held-out sums) every ``--every``
steps; then the same with each ``--recipe`` (overrides added to the preset's). It prints, per recipe, one row per
seed (the held-out accuracy at each validation) and the spread of the last one across seeds: the model the warm-up
ends with (with ``trainer.stop_at_val_score`` in a recipe, at the first validation that reached it).

The seed orders the data (the tiny model's initial weights are the same for every seed): a run whose outcome moves a
lot with it moves as much with the rounding of another CPU or torch, which orders the same arithmetic differently.

    source .rlflow/env.sh   # the servers of `rlflow server up`
    .venv/bin/python bench/warmup_seeds.py [--seeds 0 1 2 3] [--steps 700] [--every 100] [--parallel 2] \\
        [--recipe "actor.optim.weight_decay=0.1 actor.optim.lr_scheduler=cosine trainer.stop_at_val_score=0.5"] \\
        [--recipes-only]

Runs go ``--parallel`` at a time (each trains on one thread); the CPU's capability is printed beside the figures.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_description, machine_speed  # noqa: E402 (after ROOT joins the path)


def warm_up(seed: int, steps: int, every: int, recipe: list[str], runs_dir: Path) -> list[tuple[int, float]]:
    """One warm-up; its held-out accuracy by step (from its MLflow run)."""
    name = f"warmup-s{seed}-{uuid.uuid4().hex[:6]}"
    command = [
        sys.executable, "-m", "flows", "train", "sft", "--config", "demo-sft", f"trainer.runs_dir={runs_dir}",
        f"trainer.run_name={name}", f"trainer.seed={seed}", f"trainer.total_steps={steps}",
        f"trainer.test_freq={every}", "trainer.save_freq=0", "trainer.log_model=false", "trainer.n_workers=1", *recipe,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        output = done.stdout[-3000:] + done.stderr[-3000:]
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{output}")
    from mlflow.tracking import MlflowClient

    from flows.lineages.lineage import RunRecord

    record = RunRecord.read(str(runs_dir / name))  # the run's folder names its MLflow run
    history = MlflowClient().get_metric_history(record.mlflow_run_id, "val/score/mean")
    return sorted((m.step, m.value) for m in history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=700, help="trainer.total_steps (demo-sft's: 700)")
    parser.add_argument("--every", type=int, default=100, help="trainer.test_freq: a validation every this many steps")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--recipe", action="append", default=[], help="overrides added to demo-sft's (repeatable)")
    parser.add_argument("--recipes-only", action="store_true", help="leave out the preset as it is")
    args = parser.parse_args()

    print(f"CPU: {cpu_description()}")
    print(f"speed: {machine_speed()}")
    recipes = [*([] if args.recipes_only else [[]]), *(shlex.split(recipe) for recipe in args.recipe)]
    with tempfile.TemporaryDirectory(prefix="warmup-seeds-") as runs_dir, ThreadPoolExecutor(args.parallel) as pool:
        jobs = {
            (index, seed): pool.submit(warm_up, seed, args.steps, args.every, recipe, Path(runs_dir))
            for index, recipe in enumerate(recipes)
            for seed in args.seeds
        }
        for index, recipe in enumerate(recipes):
            print(f"\ndemo-sft {' '.join(recipe) or '(as it is)'}: held-out accuracy by step, one worker")
            histories = {seed: jobs[index, seed].result() for seed in args.seeds}
            steps = sorted({step for history in histories.values() for step, _ in history})
            print("seed " + "".join(f"{step:>8}" for step in steps))
            for seed, history in histories.items():
                print(f"{seed:>4} " + "".join(f"{value:>8.3f}" for _, value in history))
            last = [history[-1][1] for history in histories.values()]  # the model each warm-up ends with
            ends = sorted({history[-1][0] for history in histories.values()})
            at = f"at step {ends[0]}" if len(ends) == 1 else f"at steps {ends[0]}-{ends[-1]}"
            spread = f"{min(last):.3f}-{max(last):.3f}"
            print(f"{at}: {spread} across {len(last)} seeds (median {statistics.median(last):.3f})")


if __name__ == "__main__":
    main()
