"""What a user brings to multi-turn (agent) rollouts besides tools (``rlworkers.tools``): an environment
(``environment``: ``reset(row)`` / ``step(message)``), and the built-in examples (``examples``: a calculator tool, an
environment that says "wrong, try again"). The loop itself lives with the rollout
(``rlworkers.workers.rollout.agent_loop``)."""
