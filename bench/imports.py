"""What a process of a run spends importing: with transformers imported as rlflow imports it
(rlworkers/transformers_import.py: the distributions' map and the model table kept on disk, boto3 not imported by
accelerate), the usual way, and as rlflow's Ray workers and controllers import (the same, with the garbage collector
off while they import: rlworkers/process_start.py).

Each import runs in a fresh process, the kinds in turn (A B C A B C ...: the machine's speed drifts), ``--repeat``
rounds after one not counted (it writes what is kept); printed: the median wall and CPU seconds of each kind and
the median ratio of each to the usual way's, with the CPU beside them. The modules: a worker's
(``rlworkers.workers.actor_rollout_ref``; every worker and task host imports it) and the controller's of ``rlflow
train sft`` (``flows.sft``).

    .venv/bin/python bench/imports.py [--repeat 8] [--module rlworkers.workers.actor_rollout_ref]

"The usual way" imports ``transformers.utils.import_utils`` before rlworkers (rlworkers then leaves transformers
as it is) and sets the scikit-learn and scipy checks as rlflow did before the rest, so its ratio is that of what
is kept and of the collector. Outside a Ray worker ``import rlworkers`` leaves the collector on: the third kind
turns it off itself, as a Ray worker's start and ``flows.launch.get_flow`` do.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402

USUAL = (
    "import transformers.utils.import_utils as u; u.is_sklearn_available = u.is_scipy_available = lambda: False; "
    "import transformers.utils as t; t.is_sklearn_available = t.is_scipy_available = lambda: False; "
)


def timed(code: str) -> tuple[float, float]:
    """(wall s, CPU s) of ``python -c code`` from the process's start to its exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


KINDS = {
    "usual": USUAL,
    "rlflow": "",
    "no collect": "import gc; gc.disable(); ",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--module", action="append", help="default: the worker's module and flows.sft")
    args = parser.parse_args()
    modules = args.module or ["rlworkers.workers.actor_rollout_ref", "flows.sft"]
    print(f"CPU: {cpu_description()}; cache: {os.environ.get('XDG_CACHE_HOME') or '~/.cache'}/rlflow")
    print(f"{'module':40s} {'kind':>10s} {'wall s':>8s} {'CPU s':>8s} {'/ usual':>8s}")
    for module in modules:
        for prefix in KINDS.values():  # the first of each writes what is kept
            timed(f"{prefix}import {module}")
        runs = {kind: [] for kind in KINDS}
        for _ in range(args.repeat):
            for kind, prefix in KINDS.items():
                runs[kind].append(timed(f"{prefix}import {module}"))
        for kind, times in runs.items():
            wall, cpu = statistics.median(w for w, _ in times), statistics.median(c for _, c in times)
            ratio = statistics.median(w / u for (w, _), (u, _) in zip(times, runs["usual"]))
            print(f"{module:40s} {kind:>10s} {wall:8.2f} {cpu:8.2f} {ratio:8.2f}")


if __name__ == "__main__":
    main()
