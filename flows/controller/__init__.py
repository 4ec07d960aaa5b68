"""The controller's runtime: a training run's start (``run_start``), its state (``run_state``), the loop the flows
drive (``runtime``), its checkpoints, fault recovery, validation and evaluation, and the final model's publishing;
the worker groups it drives (``groups``), the rows it reads (``rows``) and the start-up's clock (``startup``)."""
