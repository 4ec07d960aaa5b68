"""What a process of a run spends importing, with transformers imported as rlflow imports it
(rlworkers/transformers_import.py: the distributions' map and the model table kept on disk) and the usual way.

Each import runs in a fresh process, the two kinds in turn (A B A B ...: the machine's speed drifts), ``--repeat``
pairs after one pair not counted (it writes what is kept); printed: the median wall and CPU seconds of each kind and
their ratio, with the CPU beside them. The modules: a worker's (``rlworkers.workers.actor_rollout_ref``; every
worker and task host imports it) and the controller's of ``rlflow train sft`` (``flows.sft``).

    .venv/bin/python bench/imports.py [--repeat 8] [--module rlworkers.workers.actor_rollout_ref]

"The usual way" imports ``transformers.utils.import_utils`` before rlworkers (rlworkers then leaves transformers
as it is) and sets the scikit-learn and scipy checks as rlflow did before the rest was kept on disk, so the ratio
is that of what is kept on disk.
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
from startup import cpu_description  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--module", action="append", help="default: the worker's module and flows.sft")
    args = parser.parse_args()
    modules = args.module or ["rlworkers.workers.actor_rollout_ref", "flows.sft"]
    print(f"CPU: {cpu_description()}; cache: {os.environ.get('XDG_CACHE_HOME') or '~/.cache'}/rlflow")
    columns = ("kept wall", "usual wall", "kept CPU", "usual CPU", "ratio wall")
    print(f"{'module':40s} " + " ".join(f"{column:>10s}" for column in columns))
    for module in modules:
        kept_code, usual_code = f"import {module}", f"{USUAL}import {module}"
        timed(kept_code), timed(usual_code)  # the first writes what is kept
        kept, usual = [], []
        for _ in range(args.repeat):
            kept.append(timed(kept_code))
            usual.append(timed(usual_code))
        wall_k, wall_u = (statistics.median(w for w, _ in runs) for runs in (kept, usual))
        cpu_k, cpu_u = (statistics.median(c for _, c in runs) for runs in (kept, usual))
        ratio = statistics.median(k[0] / u[0] for k, u in zip(kept, usual))
        print(f"{module:40s} {wall_k:9.2f}s {wall_u:9.2f}s {cpu_k:9.2f}s {cpu_u:9.2f}s {ratio:10.2f}")


if __name__ == "__main__":
    main()
