"""The launchers the conformance tests compare (torchrun, ``aiocoll run`` in both modes), and how they run a script."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "aiocoll": [sys.executable, "-m", "aiocoll", "run"],
}
PROCESSES = [sys.executable, "-m", "aiocoll", "run", "--processes"]  # (its processes mode, forked ranks)


def launch(
    launcher: list[str],
    tmp: Path,
    options: list[str],
    args: list[str],
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
) -> tuple[int, list[str], list[str]]:
    logs = tmp / "logs"
    # --standalone: torchrun picks a free port (without it, torch 2.10's takes 29500, and runs side by side clash)
    standalone = [] if "--master-port" in options else ["--standalone"]
    proc = subprocess.run(
        [*launcher, "--nproc-per-node", str(nproc), *standalone, "--log-dir", str(logs), *options, "script.py", *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    # from "SCRIPT" on: a script's line is one write, but torch 2.10's gloo writes its "[Gloo]
    # Rank N is connected to ..." in pieces, which another process's line can land among
    # (seen in CI: "[Gloo] Rank [Gloo] Rank SCRIPT 1: handled" under torchrun)
    out = [line[line.index("SCRIPT") :] for line in proc.stdout.splitlines() if "SCRIPT" in line]
    err = [line[line.index("SCRIPT") :] for line in proc.stderr.splitlines() if "SCRIPT" in line]
    return proc.returncode, out, err


def both(tmp_path: Path, script: str, aiocoll: list[str] = LAUNCHERS["aiocoll"]) -> list[tuple[str, list[str], Path]]:
    """Each launcher (``aiocoll``: that command) with a directory of its own holding ``script`` as ``script.py``."""
    out = []
    for name, launcher in {**LAUNCHERS, "aiocoll": aiocoll}.items():
        tmp = tmp_path / name
        tmp.mkdir()
        (tmp / "script.py").write_text(textwrap.dedent(script), encoding="utf-8")
        out.append((name, launcher, tmp))
    return out
