"""``python -m flows ...`` is the `rlflow` command (flows/forkserver.py ``main``)."""

from flows.forkserver import main

main()
