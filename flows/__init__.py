"""rlflow's Prefect flows (sft, grpo, ppo, online_dpo) and their stages (``stages``), configured by ``config``; the
controller's runtime they drive (``controller/``), lineages (``lineages/``), what they run on (``plumbing/``) and the
operations around them (``ops/``: the CLI, local servers, deployments, the demo). Each room imports only the rooms
below it (tests/test_import_cycles.py)."""

import rlworkers  # noqa: F401  (first: its adjustments of a process's imports, see rlworkers/__init__.py)
