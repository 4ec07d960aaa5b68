"""Lineages: a run's name, record and start model (``lineage``), one run of a lineage at a time (``run_lock``), the
registered versions and their champion (``versions``), held-out evaluation and the promotion gate (``evaluation``),
and a new version's promotion (``promotion``). Nothing here drives workers: the controller does."""
