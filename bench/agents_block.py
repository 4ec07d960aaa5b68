"""How long the README's "Agents: tools and environments" block takes on this machine, as a user runs it: its three
commands in the order shown, with their presets' own step counts, in a fresh folder, against servers of
`rlflow server up` started for it (on free ports, in a temporary state folder), one after another. Prints each
command's wall time, the CPU seconds the machine was busy meanwhile (run it on an otherwise idle machine), its
validation score at the start and the end, and the CPU's capability: the presets compute in float32 where the CPU
has no native bf16 (``model.autocast: auto``), so the figures depend on it.

    .venv/bin/python bench/agents_block.py [--extra "trainer.total_steps=1 ..."]

``--extra`` appends settings to every command (a shorter check of the bench itself; the README's figures are
without it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_description, machine_cpu_s, machine_speed  # noqa: E402 (after ROOT joins the path)
from flows.ops.services import free_port  # noqa: E402

HEADING = "### Agents: tools and environments"


def readme_commands() -> list[str]:
    """The command lines of the block under ``HEADING`` in README.md, comments cut."""
    section = (ROOT / "README.md").read_text().split(HEADING, 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].rstrip() for line in block.splitlines() if line.strip()]


def scores(run_dir: Path) -> str:
    """``val/score/mean`` at the start and the end of the run in ``run_dir``, from its MLflow run."""
    from mlflow.tracking import MlflowClient

    record = json.loads((run_dir / "run.json").read_text())
    history = MlflowClient().get_metric_history(record["mlflow_run_id"], "val/score/mean")
    by_step = {m.step: m.value for m in history}
    return " -> ".join(f"{by_step[s]:.3f}" for s in sorted(by_step)) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extra", default="", help="settings appended to every command")
    args = parser.parse_args()

    from flows.ops.preflight import apply_service_env
    from flows.ops.services import ServiceConfig, start_services, stop_services

    print(f"CPU: {cpu_description()}; {machine_speed()}")
    commands = readme_commands()
    with tempfile.TemporaryDirectory(prefix="rlflow-agents-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        (work / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the README's .venv/bin/rlflow
        config = ServiceConfig(
            state_dir=Path(tmp) / "home", prefect_port=free_port(), mlflow_port=free_port(), ray_port=free_port()
        )
        os.environ["PYTHONPATH"] = str(ROOT)
        urls = start_services(config)
        total = 0.0
        try:
            apply_service_env(urls)
            for command in commands:
                line = f"{command} {args.extra}".strip()
                cpu, start = machine_cpu_s(), time.perf_counter()
                done = subprocess.run(shlex.split(line), cwd=work, capture_output=True, text=True)
                wall = time.perf_counter() - start
                total += wall
                if done.returncode:
                    raise SystemExit(f"{line} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                config_name = shlex.split(command)[shlex.split(command).index("--config") + 1]
                print(
                    f"{command}\n  {wall / 60:.1f} min, {(machine_cpu_s() - cpu) / 60:.1f} CPU-min; "
                    f"val/score/mean {scores(work / 'runs' / config_name)}",
                    flush=True,
                )
        finally:
            stop_services(config)
        print(f"the block: {total / 60:.1f} min")


if __name__ == "__main__":
    main()
