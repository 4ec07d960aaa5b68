"""The controller-cost bench runs end to end, bounded, so that a change to the stages or the task runner that breaks
it fails here rather than for the next person who measures (bench/overhead.py once broke unnoticed when
``update_actor`` began returning a ``PolicyUpdate``). Its numbers are not asserted: printing them is the bench's job.
(bench/restarts_under_load.py runs in tests/test_topology.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts services, trains or installs: `make test-quick` leaves it out


def test_overhead_bench_runs_both_measurements_and_prints_their_ratios(services):
    """From a shell where `rlflow server up` runs (no Ray setting of the test process's own: the local Ray asks for
    its token, which the bench sends as a run does)."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_AUTH_MODE"}
    done = subprocess.run(
        [sys.executable, "bench/overhead.py", "--tasks", "3", "--repeats", "1", "--steps", "2", "--rounds", "1"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU: " in done.stdout, done.stdout
    assert "ratio stock / warm per-task cost:" in done.stdout, done.stdout
    assert "controller share of the step (1 - plain / runner): WarmRayTaskRunner" in done.stdout, done.stdout
    assert "WarmRayTaskRunner by round (the ways of a round back to back): " in done.stdout, done.stdout
    # the CPU each kind of process spent per step, each way: the workers' rows are there for all three ways
    table = done.stdout.split("CPU ms per step, by process", 1)[1].splitlines()
    workers = next(line for line in table if line.startswith("Ray worker actors (rlworkers)"))
    assert len(workers.split()) == 4 + 3 and all(float(value) > 0 for value in workers.split()[-3:]), table
    assert any(line.startswith("Prefect server") for line in table), table


def test_warmup_seeds_bench_prints_each_seed_and_recipe_and_the_spread(services):
    """Two 2-step warm-ups side by side (one seed, the preset and one recipe), through `rlflow train` and MLflow;
    the recipe stops at its first validation (``trainer.stop_at_val_score=0``: any score reaches it)."""
    from rlflow_cli import user_environment

    recipe = "actor.optim.weight_decay=0.1 trainer.stop_at_val_score=0"
    done = subprocess.run(
        [sys.executable, "bench/warmup_seeds.py", "--seeds", "3", "--steps", "2", "--every", "1", "--recipe", recipe],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600, env=user_environment(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU: " in done.stdout, done.stdout
    tables = done.stdout.split("demo-sft ")[1:]
    assert [table.split(":", 1)[0] for table in tables] == ["(as it is)", recipe], tables
    for table, last in zip(tables, (2, 1), strict=True):
        lines = table.splitlines()
        steps = [str(step) for step in range(last + 1)]
        assert lines[1].split() == ["seed", *steps], table  # validations at the start and every step
        row = lines[2].split()
        assert row[0] == "3" and all(0.0 <= float(value) <= 1.0 for value in row[1:]) and len(row) == last + 2, table
        assert lines[3].startswith(f"at step {last}: ") and "across 1 seeds" in lines[3], table


def test_precision_bench_prints_both_times_the_ratio_and_the_cpu():
    done = subprocess.run(
        [sys.executable, "bench/precision.py", "--model", "tiny", "--repeat", "1", "--tokens", "32"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU: torch " in done.stdout and "model.autocast=auto here: " in done.stdout, done.stdout
    assert "bf16 autocast / float32: " in done.stdout, done.stdout


def test_output_layer_bench_times_each_stage_both_ways_and_prints_the_cpu():
    done = subprocess.run(
        [sys.executable, "bench/output_layer.py", "--model", "tiny", "--prompt", "24", "--response", "4",
         "--repeat", "1"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU: " in done.stdout and "tiny, 4 sequences of 24 prompt + 4 response tokens" in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("log-prob", "update"))]
    assert len(rows) == 2 and all(float(row[-1]) > 0 for row in rows), done.stdout


def test_shared_prefix_bench_times_each_stage_both_ways_and_prints_the_cpu():
    done = subprocess.run(
        [sys.executable, "bench/shared_prefix.py", "--model", "tiny", "--config", "demo", "--rows", "4",
         "--response", "4", "--repeat", "1"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU: " in done.stdout and "tiny, demo's prompts: 4 sequences of up to " in done.stdout, done.stdout
    stages = ("generate", "log-prob", "update", "sft step", "values", "critic update")
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(stages)]
    assert len(rows) == 6 and all(float(row[-1]) > 0 for row in rows), done.stdout


def test_imports_bench_times_both_ways_and_prints_the_cpu():
    done = subprocess.run(
        [sys.executable, "bench/imports.py", "--repeat", "1", "--module", "rlworkers.models"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU: " in done.stdout and "torch " in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("rlworkers.models ")]
    assert [row[1:-3] for row in rows] == [["usual"], ["rlflow"], ["no", "collect"]], rows
    assert all(float(value) > 0 for row in rows for value in row[-3:]) and rows[0][-1] == "1.00", rows


BURN_8_CPU_S = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 8: pass"


def test_cpu_by_process_counts_what_the_command_started_and_passes_its_exit_status_on(tmp_path):
    """What CI wraps `make test` in: the CPU of the command's own children is counted by kind, its exit status is
    the script's, and a SIGTERM (CI's time limit) is passed on to the command and still prints the table."""
    root = Path(__file__).resolve().parents[1]
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN_8_CPU_S!r}]); sys.exit(3)"
    records = tmp_path / "processes.jsonl"
    done = subprocess.run(
        [sys.executable, "bench/cpu_by_process.py", "--every", "0.5", "--processes", str(records), "--",
         sys.executable, "-c", child],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "machine before: CPU: " in done.stdout and "GFLOPS" in done.stdout.split("machine after:")[1], done.stdout
    burned = next(line for line in done.stdout.splitlines() if line.endswith("other Python"))
    assert float(burned.split()[0]) >= 0.1, done.stdout  # >= 6 of its 8 CPU-s (the last sample may miss 2)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    command = next(row for row in rows if row["cmdline"].endswith(child))  # the command, and the child it started
    burner = next(row for row in rows if row["ppid"] == command["pid"])
    assert burner["cpu_s"] >= 6 and burner["kind"] == "other Python" and burner["start"] >= command["start"], rows
    times, seconds = zip(*burner["samples"])  # its CPU over time: rising, sample by sample
    assert len(times) >= 8 and list(times) == sorted(times) and list(seconds) == sorted(seconds), burner["samples"]
    assert seconds[-1] == burner["cpu_s"], burner

    stopped = subprocess.Popen(
        [sys.executable, "bench/cpu_by_process.py", "--every", "0.5", "--", "sleep", "60"],
        cwd=root, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(3)
    stopped.terminate()
    output, _ = stopped.communicate(timeout=60)
    assert stopped.returncode == 128 + signal.SIGTERM and "CPU by kind of process" in output, output


def test_cpu_by_process_tells_rlflow_s_processes_apart():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from cpu_by_process import kind

    assert kind("ray::TaskHost", "ray::TaskHost") == "task host and other Ray tasks"
    assert kind("ray::ActorRolloutRefWorker.generate_sequences", "ray::ActorRollo") == "Ray worker actors (rlworkers)"
    assert kind("ray::IDLE", "ray::IDLE") is None  # not yet known: asked again at the next sample
    assert kind("/x/.venv/bin/python -m flows.ops.cli train grpo --config demo", "python") == "rlflow CLI (controller)"
    assert kind("/x/.venv/bin/python -m flows train grpo --config demo", "python") == "rlflow CLI (controller)"
    assert kind("rlflow train grpo --config demo", "python") == "rlflow CLI (controller)"  # forked, named so
    assert kind("/x/.venv/bin/python /x/flows/ops/warm_controller.py /x/.rlflow/controller.sock", "python") == (
        "controller fork server"
    )
    assert kind("/x/.venv/bin/python -m prefect server start --host 127.0.0.1", "python") == "Prefect server"
    assert kind("/x/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray", "gcs_server") == "Ray's own processes"
    raylet = "/x/ray/core/src/ray/raylet/raylet --python_worker_command=/x/python /x/workers/default_worker.py"
    assert kind(raylet, "raylet") == "Ray's own processes"  # not a worker before its title, which its flags name
    assert kind("/x/python /x/ray/_private/workers/default_worker.py --node-ip-address=1", "python") is None
    assert kind("/x/python -u -c import sys;exec(eval(sys.stdin.readline()))", "python") == "test processes (pytest)"


def test_suite_by_test_gives_a_process_to_the_test_its_pytest_process_ran_and_shares_the_local_rays():
    """bench/suite_by_test.py: a command a test ran (and what it started) is that test's; a worker of the session's
    local Ray (under `ray start --head`) is shared by the tests running when it started, one share each."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from suite_by_test import attribute

    tests = [
        {"test": "tests/test_a.py::test_one", "pid": 10, "start": 0.0, "end": 100.0},
        {"test": "tests/test_a.py::test_two", "pid": 10, "start": 100.0, "end": 200.0},
        {"test": "tests/test_b.py::test_three", "pid": 20, "start": 0.0, "end": 200.0},
    ]
    cli, worker, ray = "rlflow CLI (controller)", "Ray worker actors (rlworkers)", "Ray's own processes"
    processes = [
        {"pid": 11, "ppid": 10, "start": 120.0, "cpu_s": 8.0, "kind": cli, "cmdline": "python -m flows.ops.cli train"},
        {"pid": 12, "ppid": 11, "start": 125.0, "cpu_s": 6.0, "kind": worker, "cmdline": "ray::ActorRolloutRefWorker"},
        {"pid": 21, "ppid": 20, "start": 1.0, "cpu_s": 1.0, "kind": ray, "cmdline": "ray start --head --block"},
        {"pid": 22, "ppid": 21, "start": 50.0, "cpu_s": 4.0, "kind": worker, "cmdline": "ray::ActorRolloutRefWorker"},
    ]
    cpu, started = attribute(tests, processes)
    assert cpu["tests/test_a.py::test_two"]["cli"] == 8.0 and cpu["tests/test_a.py::test_two"]["workers"] == 6.0
    assert cpu["tests/test_a.py::test_one"]["workers"] == cpu["tests/test_b.py::test_three"]["workers"] == 2.0
    assert started["tests/test_b.py::test_three"]["workers"] == 0.5
    assert cpu["tests/test_b.py::test_three"]["ray"] == 1.0  # the `ray start` itself: the test that ran it
    assert cpu["tests/test_a.py::test_one"]["(wall s)"] == 100.0


def test_suite_by_test_counts_cpu_when_it_was_used():
    """With each process's CPU over time (bench/cpu_by_process.py's samples), a kept worker of the local Ray is the
    tests' running when it computed, not the one that started it; a pytest process's own CPU (the flows it runs) is
    its running test's; what no test was running for is "(between tests)"."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from suite_by_test import attribute

    tests = [
        {"test": "tests/test_a.py::test_one", "pid": 10, "start": 0.0, "end": 100.0},
        {"test": "tests/test_a.py::test_two", "pid": 10, "start": 100.0, "end": 200.0},
        {"test": "tests/test_b.py::test_three", "pid": 20, "start": 0.0, "end": 200.0},
    ]
    processes = [
        {"pid": 10, "ppid": 1, "start": 0.0, "cpu_s": 10.0, "kind": "test processes (pytest)", "cmdline": "python -c",
         "samples": [[50.0, 3.0], [150.0, 10.0]]},
        {"pid": 30, "ppid": 1, "start": 0.0, "cpu_s": 1.0, "kind": "Ray's own processes",
         "cmdline": "ray start --head"},
        {"pid": 31, "ppid": 30, "start": 20.0, "cpu_s": 7.0, "kind": "Ray worker actors (rlworkers)",
         "cmdline": "ray::ActorRolloutRefWorker", "samples": [[50.0, 1.0], [150.0, 5.0], [250.0, 7.0]]},
    ]  # fmt: skip
    cpu, started = attribute(tests, processes)
    assert cpu["tests/test_a.py::test_one"]["pytest"] == 3.0 and cpu["tests/test_a.py::test_two"]["pytest"] == 7.0
    assert cpu["tests/test_a.py::test_one"]["workers"] == 0.5 and cpu["tests/test_a.py::test_two"]["workers"] == 2.0
    assert cpu["tests/test_b.py::test_three"]["workers"] == 2.5 and cpu["(between tests)"]["workers"] == 2.0
    assert started["tests/test_a.py::test_one"]["workers"] == 0.5 and not started["tests/test_a.py::test_one"]["pytest"]


def test_the_staleness_bench_tells_a_sum_with_a_carry_from_one_without_in_both_prompt_forms():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.staleness import carries

    assert not carries("12+34=") and not carries("40+5=")
    assert carries("15+27=") and carries("9+1=") and carries("95+8=")  # units; units into a longer number
    assert carries("50+60=") and not carries("0+0=")  # tens
    assert carries([{"role": "user", "content": "What is 38 + 4? Reply with the number only."}])
    assert not carries([{"role": "user", "content": "What is 21 + 3? Reply with the number only."}])
