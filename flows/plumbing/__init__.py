"""What the flows run on: the Prefect task runner on Ray (``task_runner``, and the Prefect names beyond its public
contract, ``prefect_internals``), the worker processes kept in the local Ray between runs (``kept``), the controller
fork server's protocol (``forkserver``), the Prefect and MLflow servers a run checks before it starts (``servers``)
and MLflow tracking with Prefect artifacts (``tracking``). Nothing here knows RL."""
