"""rlflow's Prefect flows, stages, tracking and CLI."""

import rlworkers  # noqa: F401  (first: its adjustments of a process's imports, see rlworkers/__init__.py)
