"""rlworkers/process_start.py: the garbage collector during a process's imports (a Ray worker's are tested with a
worker group in tests/test_single_controller.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from rlworkers.process_start import collector_off_while_importing, pause_gc_while_importing


def test_the_collector_is_off_in_the_block_and_as_it_was_after():
    assert gc.isenabled()
    with collector_off_while_importing():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_off_while_importing():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_outside_a_ray_worker_import_rlworkers_leaves_the_collector_on():
    pause_gc_while_importing()  # what `import rlworkers` calls; this process is no Ray worker
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_controller_imports_its_flow_without_a_full_collection_and_collects_after():
    # (the young generation is collected once as the collector is turned on again: it is not counted)
    code = (
        "import gc, json; full = []; "
        "gc.callbacks.append(lambda phase, info: phase == 'start' and info['generation'] == 2 and full.append(1)); "
        "from flows.launch import get_flow; before = len(full); flow = get_flow('grpo'); during = len(full) - before; "
        "print(json.dumps({'during': during, 'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count(), "
        "'flow': flow.name}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == {"during": 0, "enabled": True, "frozen": 0, "flow": "grpo"}
