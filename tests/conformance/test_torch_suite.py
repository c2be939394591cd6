"""torch's own multi-process suite, ``distributed_test.py`` (shipped in every wheel), on the drop-in.

torch runs it through ``test/distributed/test_distributed_spawn.py`` with ``BACKEND=gloo``;
the runner below builds its test class the same way, in a fresh interpreter (the suite
reads its environment as it is imported), and runs a few of its tests in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

RUNNER = """
import json, sys, unittest
import aiocoll.testing
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

class Suite(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

with aiocoll.testing.replace_process_harness(fallback="skip"):
    result = unittest.TextTestRunner(verbosity=0).run(unittest.TestSuite(Suite(n) for n in sys.argv[1:]))
print("RESULT", json.dumps({
    "run": result.testsRun,
    "failed": [t.id().rsplit(".", 1)[1] for t, _ in result.failures + result.errors],
    "skipped": {t.id().rsplit(".", 1)[1]: reason for t, reason in result.skipped},
}))
"""


def _run(tmp_path: Path, tests: list[str], **env: str) -> tuple[dict[str, Any], str]:
    """Run ``tests`` of the suite in-process: its result, and the run's stderr."""
    (tmp_path / "barrier").mkdir()  # (the suite checks it is there as it is imported)
    (tmp_path / "runner.py").write_text(textwrap.dedent(RUNNER), encoding="utf-8")
    # (CUDA hidden: on a machine with fewer GPUs than ranks, the gloo suite skips its tests)
    environ = {
        **os.environ,
        "BACKEND": "gloo",
        "WORLD_SIZE": "3",
        "TEMP_DIR": str(tmp_path),
        "CUDA_VISIBLE_DEVICES": "",
        **env,
    }
    proc = subprocess.run(
        [sys.executable, "runner.py", *tests],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[0].split(" ", 1)[1])
    assert result["run"] == len(tests)
    return result, proc.stderr


def test_torchs_own_suite_meets_in_its_barrier_and_sends_what_needs_processes_there(tmp_path: Path) -> None:
    tests = ["test_barrier", "test_send_recv", "test_batch_isend_irecv_gloo", "test_get_rank", "test_all_reduce_sum"]
    result, stderr = _run(tmp_path, tests)
    assert result["failed"] == [], stderr[-5000:]
    skipped = result["skipped"]  # (fallback="skip": these would run in processes)
    # test_get_rank names a file after each rank's os.getpid(): a pid of its own in-process
    assert sorted(skipped) == ["test_all_reduce_sum"]
    assert "started torch's profiler (one per process)" in skipped["test_all_reduce_sum"]


def test_torchs_own_timeout_tests_pass(tmp_path: Path) -> None:
    # a group's own timeout and monitored_barrier's, as gloo keeps them: these failed
    # in-process (fb7c430's parent); test_barrier_timeout_global needs a file:// init method
    tests = [
        "test_barrier_timeout_full_group",
        "test_barrier_timeout_global",
        "test_monitored_barrier_gloo",
        "test_monitored_barrier_gloo_rank_0_timeout",
        "test_monitored_barrier_gloo_subgroup",
    ]
    result, stderr = _run(tmp_path, tests, INIT_METHOD=f"file://{tmp_path}/init")
    assert result["failed"] == [], stderr[-5000:]
    assert result["skipped"] == {}
