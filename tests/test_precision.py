"""Precision for the hardware: ``model.autocast=auto`` is bf16 where the device computes it natively and float32
elsewhere, whatever CPU runs the test (the CPU's capability is mocked both ways); bf16 forced on a CPU that only
emulates it runs but warns; ``none`` turns a preset's autocast off from the command line."""

from __future__ import annotations

import logging

import pytest
import torch

from flows.config import load_config
from rlworkers.workers import common
from rlworkers.workers.config import ModelConfig

SMOLLM2_PRESETS = ["real-sft", "real-gsm8k", "agent-sft", "agent", "agent-env"]


@pytest.fixture(params=["avx2", "amx"])
def cpu(request, monkeypatch):
    """This process's CPU seen as an AVX2-only one (no native bf16) or as one with AMX and AVX512-BF16."""
    native = request.param == "amx"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    common.native_bf16.cache_clear()
    yield request.param
    common.native_bf16.cache_clear()


@pytest.mark.parametrize("preset", SMOLLM2_PRESETS)
def test_smollm2_presets_compute_in_bf16_only_where_it_is_native(preset, cpu):
    model = load_config(preset).model
    assert model.autocast == "auto" and model.dtype == "float32"
    assert common.resolve_autocast(model, "cpu") == ("bfloat16" if cpu == "amx" else None)
    report = common.precision_report(model, "cpu")
    assert report["slow"] is False
    if cpu == "amx":
        assert report["autocast"] == "bfloat16" and "AMX and AVX512-BF16" in report["reason"]
    else:
        assert report["autocast"] == "none" and "no AMX or AVX512-BF16" in report["reason"]


def test_the_autocast_context_follows_the_resolution(cpu):
    context = common.autocast(ModelConfig(autocast="auto"), "cpu")
    with context:
        enabled = torch.is_autocast_enabled("cpu")
    assert enabled is (cpu == "amx")
    with common.autocast(ModelConfig(), "cpu"):  # unset: float32
        assert not torch.is_autocast_enabled("cpu")
    with common.autocast(ModelConfig(autocast="bfloat16"), "cpu"):  # forced: bf16 on every CPU
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_forced_bf16_on_an_emulating_cpu_is_flagged_slow(cpu):
    report = common.precision_report(ModelConfig(autocast="bfloat16"), "cpu")
    assert report["autocast"] == "bfloat16"
    assert report["slow"] is (cpu == "avx2")
    assert common.precision_report(ModelConfig(), "cpu") == {
        "autocast": "none",
        "reason": "model.autocast is unset: float32 compute",
        "slow": False,
    }


def test_cuda_without_a_gpu_resolves_to_float32():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: this checks the resolution where CUDA is absent")
    assert common.resolve_autocast(ModelConfig(autocast="auto"), "cuda") is None
    assert "CUDA is not available" in common.precision_report(ModelConfig(autocast="auto"), "cuda")["reason"]


@pytest.mark.parametrize("spelled", ["none", "null", "~", "off", "None", "false"])
def test_a_presets_autocast_turned_off_on_the_command_line(spelled):
    assert load_config("agent-sft", [f"model.autocast={spelled}"]).model.autocast is None


def test_the_run_logs_warns_and_records_its_precision(cpu, monkeypatch):
    """flows.controller.run_start.record_precision: what the actor workers report reaches the log, a warning when bf16
    is forced where it is emulated, and the run's params and tags."""
    from flows.controller import run_start

    class Actor:  # the group's ONE_TO_ALL call answers one report per worker
        def __init__(self, model):
            self.model = model

        def get_precision(self):
            return [common.precision_report(self.model, "cpu")]  # what ActorRolloutRefWorker.get_precision returns

    class Tracker:
        params, tags = {}, {}

        def log_params(self, params):
            self.params.update(params)

        def set_tags(self, tags):
            self.tags.update(tags)

    actor = Actor(ModelConfig(autocast="bfloat16"))
    records = []
    logger = logging.getLogger("rlflow-test-precision")
    logger.addHandler(type("Keep", (logging.Handler,), {"emit": lambda self, record: records.append(record)})())
    monkeypatch.setattr(run_start, "get_run_logger", lambda: logger)
    tracker = Tracker()
    run_start.record_precision(actor, tracker)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert tracker.params["precision.autocast"] == "bfloat16" and tracker.tags["rlflow.precision"].startswith("bf")
    if cpu == "avx2":
        assert len(warned) == 1 and "13x slower than float32" in warned[0] and "model.autocast=auto" in warned[0]
    else:
        assert not warned
