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


def test_torchs_own_suite_meets_in_its_barrier_and_sends_what_needs_processes_there(tmp_path: Path) -> None:
    (tmp_path / "barrier").mkdir()  # (the suite checks it is there as it is imported)
    (tmp_path / "runner.py").write_text(textwrap.dedent(RUNNER), encoding="utf-8")
    env = {**os.environ, "BACKEND": "gloo", "WORLD_SIZE": "3", "TEMP_DIR": str(tmp_path)}
    tests = ["test_barrier", "test_send_recv", "test_batch_isend_irecv_gloo", "test_get_rank", "test_all_reduce_sum"]
    proc = subprocess.run(
        [sys.executable, "runner.py", *tests],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[0].split(" ", 1)[1])
    assert result["run"] == 5
    assert result["failed"] == [], proc.stderr[-5000:]
    skipped = result["skipped"]  # (fallback="skip": these would run in processes)
    assert sorted(skipped) == ["test_all_reduce_sum", "test_get_rank"]
    assert "took its process id (os.getpid()), which the ranks of one process share" in skipped["test_get_rank"]
    assert "started torch's profiler (one per process)" in skipped["test_all_reduce_sum"]
