"""GRPO on an existing two-node Ray cluster (two `ray start`s on this machine, each with its own resources and temp
dir), started by `rlflow train` with trainer.ray_address as a user would, its roles laid out as verl's resource pools
(the actor's, and a reference and a reward model on pools of their own). The second node is stopped mid-run (SIGTERM
to its raylet and everything under it, what `ray stop` does on that machine); the run replaces the workers it lost,
waits for room while there is none, and finishes once the node is back, with the weights of the same job run
uninterrupted on the same cluster. And a one-node cluster reached as KubeRay hands one out (Ray Client, ray://),
shared by two lineages at once, with Ray's state API checking that runs leave nothing behind.

Both nodes run with RAY_enable_metrics_collection=0. With metrics on and the node SIGKILLed, on this 2-core machine
the head's GCS and dashboard agent kept both cores busy afterwards and starved the restarted workers; which of the
two changes cured it was not isolated.

Their workers run at nice 0 (RAY_worker_niceness=0, Ray's default is 15): beside another test whose processes run at
nice 0 (servers, controllers, Ray workers still importing ray) a nice-15 worker gets ~3% of a core, and in CI the Ray
Client test's 6 worker processes were still importing 300 s after they started (reproduced here: two nice-0 loops
beside the test, its task host still in `import mlflow` after 280 s). At equal niceness each gets its share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from rlflow_cli import rlflow_in_background
from safetensors.torch import load_file

from flows.ops.services import free_port
from rlworkers.models.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
pytestmark = pytest.mark.slow


class Node:
    """One `ray start` (head or worker) with its own temp dir; stopped by killing its processes, not `ray stop`
    (which would end every Ray on the machine, the test session's own included)."""

    def __init__(self, env: dict, num_cpus: int, head_port: int | None = None, resources: str = "{}", head_options=()):
        self.env, self.num_cpus, self.head_port, self.resources = env, num_cpus, head_port, resources
        self.head_options = list(head_options) or ["--include-dashboard=false"]
        self.temp_dir = tempfile.mkdtemp(prefix="rlr-", dir="/tmp")  # short: Ray's socket paths have a length limit

    def start(self, address: str | None = None) -> None:
        args = [
            RAY,
            "start",
            f"--num-cpus={self.num_cpus}",
            f"--resources={self.resources}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            f"--dashboard-agent-listen-port={free_port()}",
        ]
        args += [f"--address={address}"] if address else ["--head", f"--port={self.head_port}", *self.head_options]
        subprocess.run(args, env=self.env, check=True, capture_output=True, timeout=120)

    def processes(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            if self.temp_dir in " ".join(process.info["cmdline"] or []):
                found.append(process)
                found.extend(process.children(recursive=True))
        return list({p.pid: p for p in found}.values())

    def kill(self, sig=signal.SIGKILL) -> None:
        processes = self.processes()
        for process in processes:
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(processes, timeout=30)
        for process in alive:
            process.kill()


def cluster_env() -> dict:
    """The environment of a test cluster's `ray start`s (see the module's docstring): token authentication (the
    default of `ray start`), rlflow importable, no metrics, workers at nice 0, and no RAY_ADDRESS of the session's."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "PYTHONPATH": str(ROOT),
        "RAY_enable_metrics_collection": "0",
        "RAY_worker_niceness": "0",
    }
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture
def cluster(services):
    env = cluster_env()
    port = free_port()
    head = Node(env, num_cpus=2, head_port=port)
    other = Node(env, num_cpus=3, resources='{"second_node": 1}')
    head.start()
    other.start(address=f"127.0.0.1:{port}")
    yield {"address": f"127.0.0.1:{port}", "env": env, "head": head, "other": other}
    other.kill()
    head.kill()
    left = head.processes() + other.processes()
    assert not left, [p.cmdline()[:2] for p in left]


def stacks(node: Node) -> str:
    """Each Ray worker process of ``node``: its title, niceness, CPU seconds and Python stack (py-spy, which
    ray[default] installs), for a test that waited too long to say where they were."""
    py_spy = Path(sys.executable).with_name("py-spy")
    lines = []
    for process in node.processes():
        try:
            title, nice, cpu = process.cmdline()[0].split()[0], process.nice(), sum(process.cpu_times()[:2])
        except (psutil.Error, IndexError):
            continue
        if title.startswith("ray::"):
            dump = subprocess.run(
                [py_spy, "dump", "--pid", str(process.pid)], capture_output=True, text=True, timeout=60
            )
            lines.append(
                f"{process.pid} {title} nice {nice} cpu {cpu:.1f} s\n{dump.stdout[-3000:]}{dump.stderr[-500:]}"
            )
    return "\n".join(lines)


def rlflow_workers_on(node: Node) -> list[str]:
    return [
        p.cmdline()[0].split()[0]
        for p in node.processes()
        if p.cmdline() and p.cmdline()[0].startswith(("ray::ActorRolloutRefWorker", "ray::RewardWorker"))
    ]


def test_grpo_on_two_nodes_survives_losing_one(cluster, tmp_path):
    name = f"cluster-{uuid.uuid4().hex[:6]}"
    model = ensure_tiny_model(tmp_path / "tiny")
    runs = tmp_path / "runs"  # one disk for both "nodes" here; on real machines, a shared or s3:// path

    def command(run_name: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "flows",
            "train",
            "grpo",
            "--config",
            "demo",
            f"model.path={model}",
            f"trainer.runs_dir={runs}",
            f"trainer.run_name={run_name}",
            f"trainer.ray_address={cluster['address']}",
            "trainer.total_steps=6",
            "trainer.save_freq=2",
            "trainer.test_freq=0",
            "trainer.log_model=false",
            "trainer.log_samples=0",
            "data.train_batch_size=8",
            "data.val_batch_size=8",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size_per_gpu=8",
            # verl's pools: the actor's two processes (the rollout in them), a reference and a reward model on
            # pools of their own: 3.5 CPUs in all, more than either node holds alone
            "resource_pool.spec={train: [2], ref: [1], reward: [1]}",
            "resource_pool.mapping={actor: train, rollout: train, ref: ref, reward: reward}",
        ]

    clean = subprocess.run(
        command(f"{name}-clean"), env=cluster["env"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )  # the same job, uninterrupted, on the same cluster
    assert clean.returncode == 0, (clean.stdout + clean.stderr)[-3000:]
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        train = subprocess.Popen(command(name), env=cluster["env"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        checkpoint = runs / name / "checkpoints" / "step_2" / "manifest.json"
        deadline = time.monotonic() + 300
        while not checkpoint.exists():
            assert train.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step-2 checkpoint within 300 s"
            time.sleep(0.5)
        # 3.5 CPUs of worker groups do not fit on either node alone: both hold some
        assert rlflow_workers_on(cluster["head"]) and rlflow_workers_on(cluster["other"]), (
            rlflow_workers_on(cluster["head"]),
            rlflow_workers_on(cluster["other"]),
        )
        cluster["other"].kill(signal.SIGTERM)  # the second node is stopped, as `ray stop` would
        deadline = time.monotonic() + 300
        while "waiting for capacity" not in log.read_text():  # nowhere to put what the node held
            assert train.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no wait for capacity within 300 s:\n" + log.read_text()[-3000:]
            time.sleep(1)
        cluster["other"].start(address=cluster["address"])  # ... and comes back
        assert train.wait(timeout=600) == 0, log.read_text()[-5000:]
    finally:
        if train.poll() is None:
            train.kill()
    text = log.read_text()
    assert "recovered in" in text, text[-3000:]
    client = MlflowClient()
    run = client.search_runs(
        [client.get_experiment_by_name("rlflow").experiment_id], filter_string=f"tags.`rlflow.run_name` = '{name}'"
    )[0]
    assert run.info.status == "FINISHED"
    # one restart, or two when the first came before Ray had marked the node dead (~15 s) and placed on it again
    assert [m.value for m in client.get_metric_history(run.info.run_id, "fault/restarts")] in ([1], [1, 2])
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "timing_s/step")) == 6
    # the same seed on the same CPU: the run that lost a node ends with the uninterrupted run's weights
    clean_weights = load_file(f"{runs}/{name}-clean/final_model/model.safetensors")
    weights = load_file(f"{runs}/{name}/final_model/model.safetensors")
    assert all(torch.equal(clean_weights[k], weights[k]) for k in clean_weights)


def test_a_local_run_does_not_join_a_cluster_it_was_not_given(services, tmp_path):
    """A `ray start` on this machine with Ray's default temp dir leaves /tmp/ray/ray_current_cluster behind (and a
    killed one leaves it stale); Ray's ``ray.init()`` joins whatever it names. With trainer.ray_address unset,
    `rlflow train` must start a Ray of its own instead of joining it and failing (with Ray's "When connecting to an
    existing cluster, num_cpus and num_gpus must not be provided" where one runs there, as the demo preset sets
    trainer.ray_num_cpus; unable to connect where it is stale, as here)."""
    from ray._private.utils import get_ray_address_file

    address_file = Path(get_ray_address_file(None))
    saved = address_file.read_text() if address_file.exists() else None
    address_file.parent.mkdir(parents=True, exist_ok=True)
    address_file.write_text(f"127.0.0.1:{free_port()}")  # what a killed `ray start --head` (default temp dir) left
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLFLOW_LOCAL_RAY")}  # no Ray given
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flows", "train", "grpo", "--config", "demo", "model.path=tiny",
             f"trainer.runs_dir={tmp_path}", "trainer.run_name=own-ray", "trainer.total_steps=1",
             "trainer.test_freq=0", "trainer.log_model=false", "trainer.log_samples=0"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        if saved is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(saved)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Starting a local Ray" in output and "must not be provided" not in output


@pytest.fixture
def client_cluster(services):
    """A one-node cluster as KubeRay hands one out: a head with Ray Client's server (ray://) and the dashboard
    (Ray's state API), token authentication on."""
    env = cluster_env()
    port, client_port, dashboard_port = free_port(), free_port(), free_port()
    head = Node(
        env,
        num_cpus=8,
        head_port=port,
        head_options=[
            f"--ray-client-server-port={client_port}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
        ],
    )
    head.start()
    yield {
        "address": f"127.0.0.1:{port}",
        "client": f"ray://127.0.0.1:{client_port}",
        "dashboard": f"http://127.0.0.1:{dashboard_port}",
        "env": env,
        "head": head,
    }
    head.kill()
    assert not head.processes()


def cluster_state(cluster) -> dict:
    """Live actors and placement groups of the cluster, from Ray's state API, as {"actors": [...], "groups": [...]}
    of (job id, name, state)."""
    script = f"""
import json
from ray.util.state import list_actors, list_placement_groups
address = {cluster["dashboard"]!r}
actors = [(a.job_id, a.class_name, a.state) for a in list_actors(address=address, limit=1000) if a.state != "DEAD"]
groups = [
    (g.creator_job_id, g.name, g.state)
    for g in list_placement_groups(address=address, limit=1000, detail=True) if g.state != "REMOVED"
]
print(json.dumps({{"actors": actors, "groups": groups}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], env=cluster["env"], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_until_empty(cluster, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        state = cluster_state(cluster)
        if not state["actors"] and not state["groups"] or time.monotonic() > deadline:
            return state
        time.sleep(3)


def test_two_lineages_share_a_cluster_through_ray_client_and_leave_nothing_behind(client_cluster, tmp_path):
    """Two lineages at once on one cluster, one through Ray Client (ray://) and one through the head's GCS address:
    both finish and publish their own model; then a Ray Client run killed mid-run (SIGKILL of its process group)
    and a run whose reward function fails: Ray's state API shows no actor or placement group left after each."""
    cluster, tag = client_cluster, uuid.uuid4().hex[:6]
    runs = tmp_path / "runs"
    env = {"RAY_AUTH_MODE": "token"}

    def train(lineage: str, address: str, *overrides: str):
        return rlflow_in_background(
            "train", "grpo", "--config", "demo", "model.path=tiny", f"trainer.runs_dir={runs}",
            f"trainer.lineage={lineage}", "trainer.run_name=null", f"trainer.ray_address={address}",
            "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=0", "trainer.log_samples=0",
            *overrides, env=env,
        )  # fmt: skip

    def finish(process, timeout: float = 600) -> str:
        output, _ = process.communicate(timeout=timeout)
        return output

    # both runs' rewards wait for a file the test writes once it has seen both hold their placement groups: how long
    # either takes to start (Ray Client's is slower) cannot make them miss each other
    gate = tmp_path / "both-running"
    waiting = tmp_path / "waiting_reward.py"
    waiting.write_text(
        "import os, time\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    deadline = time.monotonic() + 300\n"
        f"    while not os.path.exists({str(gate)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.2)\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    reward = f"custom_reward_function.path={waiting}"
    first = {
        "a": train(f"rc-a-{tag}", cluster["client"], reward),
        "b": train(f"rc-b-{tag}", cluster["address"], reward),
    }
    jobs_at_once, deadline = set(), time.monotonic() + 300
    while len(jobs_at_once) < 2 and time.monotonic() < deadline and all(p.poll() is None for p in first.values()):
        groups = cluster_state(cluster)["groups"]
        jobs_at_once = {job for job, _, state in groups if state == "CREATED"}
        time.sleep(2)
    gate.touch()
    outputs = {name: finish(process) for name, process in first.items()}
    for name, process in first.items():
        assert process.returncode == 0, outputs[name][-4000:]
    assert len(jobs_at_once) == 2, "the two runs never held placement groups at the same time"
    client = MlflowClient()
    for name in first:
        version = client.get_model_version(f"rc-{name}-{tag}", "1")  # each lineage published its own run's model
        assert client.get_run(version.run_id).data.tags["rlflow.lineage"] == f"rc-{name}-{tag}"
    assert "Connecting to the Ray cluster at ray://" in outputs["a"]
    left = wait_until_empty(cluster, 60)
    assert left == {"actors": [], "groups": []}, left

    broken = tmp_path / "broken_reward.py"
    broken.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('a bug in the reward function')\n"
    )
    killed = train(f"rc-c-{tag}", cluster["client"])
    failing = train(f"rc-d-{tag}", cluster["address"], f"custom_reward_function.path={broken}")
    deadline = time.monotonic() + 300
    while not list(runs.glob(f"rc-c-{tag}-*/checkpoints/step_1/manifest.json")):  # <lineage>-<time>-<run id>
        assert killed.poll() is None, killed.stdout.read()[-4000:]
        assert time.monotonic() < deadline, (
            f"no step-1 checkpoint within 300 s; the workers:\n{stacks(cluster['head'])}"
        )
        time.sleep(0.5)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    output = finish(failing)
    assert failing.returncode != 0 and "a bug in the reward function" in output, output[-4000:]
    # a dead Ray Client's job is cleaned up once its reconnect grace period (30 s) has passed
    left = wait_until_empty(cluster, 180)
    assert left == {"actors": [], "groups": []}, left
