"""Operations: the `rlflow` command line (``cli``), the local servers (``services``), deployments and schedules
(``deploy``), pointing a process at the servers (``preflight``), ``make demo`` (``demo``) and the controller fork
server's process (``warm_controller``). Nothing in flows imports this package but ``flows/__main__.py``."""
