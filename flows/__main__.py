"""``python -m flows ...`` and the `rlflow` script: the command runs in a child of the controller fork server when
one is up and takes it (flows/plumbing/forkserver.py), else in this process (flows/ops/cli.py)."""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from flows.plumbing.forkserver import OWN_PROCESS_COMMANDS, run_forked


def main() -> NoReturn:
    code = None if sys.argv[1:2] and sys.argv[1] in OWN_PROCESS_COMMANDS else run_forked(sys.argv)
    if code is None:
        from flows.ops.cli import run_command

        run_command()  # ends the process
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # the command died of signal -code: so does this process, for whoever waits for it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    main()
