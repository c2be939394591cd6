"""What a world leaves behind: RSS and live objects over many worlds in one process, per way in.

Run from the repository root::

    python benchmarks/bench_leftovers.py                       # 1,000 worlds per entry point
    python benchmarks/bench_leftovers.py --worlds 200 --entry spawn --entry plugin

Each entry point (``spawn``, the pytest plugin, both harness drop-ins, and torch's own
threaded process group for comparison) runs in a fresh interpreter: ``--warmup`` worlds
first (imports, first-use set-ups, torch's caches of things that are not a world's),
then ``--worlds`` more of the same program (``_worlds.program``: DeviceMesh, DTensor
placements and redistributes, tensor parallel, FSDP2, a distributed checkpoint). After
every ``--every`` worlds the child collects garbage and reads its RSS and the number of
objects the collector tracks. The table gives both after warm-up and at the end, the
growth per world, and whether it stays within the bound; the ratio column compares
each entry's growth per world with torch's threaded PG's.

torch 2.10 to 2.12 leak the arguments (DTensorSpecs, sharding strategies) of every
``OpSchema`` they hash, in any process (pytorch#181761): the "torch pins" column counts
what that leak keeps of the new objects (0 on a torch without it), and the bound and
ratio leave it out.

The bound (``--bound-objects``, ``--bound-mb``) is on the whole run after warm-up, not
per world: a world that leaves nothing behind leaves the counts flat however many
worlds run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _worlds import ENTRY_POINTS


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _pinned_by_torch(before: set[int]) -> int:
    """Tracked objects made since ``before`` that torch's own OpSchema leak keeps alive.

    torch 2.10 to 2.12 leak a reference to the tuple (or dict) of arguments of each
    ``OpSchema`` they hash (pytorch#181761), in any process. Such a container holds
    DTensorSpecs or sharding strategies and no tracked object refers to it (only C++
    does); what it reaches among the new objects stays for good, whatever aiocoll
    releases. 0 on a torch without the leak.
    """
    import gc
    import types

    from aiocoll._torch import pins_dtensor_specs

    if not pins_dtensor_specs():
        return 0
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import StrategyType

    schema_args = (DTensorSpec, StrategyType)  # what an OpSchema's arguments are made of

    objects = gc.get_objects()
    orphans = {
        id(o): o
        for o in objects
        if id(o) not in before
        and (type(o) is tuple or type(o) is dict)
        and any(isinstance(x, schema_args) for x in (o.values() if type(o) is dict else o))
    }
    # never a module's referents: on Python 3.12 that walks _asyncio's free list, which
    # then sends the next full collection round forever. A module refers to its dict
    # and state, never to such a tuple.
    for o in objects:
        if type(o) is not types.ModuleType:
            for r in gc.get_referents(o):
                orphans.pop(id(r), None)
    stack = list(orphans.values())
    del objects, orphans
    seen: set[int] = set()
    pinned = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or id(o) in before or type(o) is types.ModuleType:
            continue
        seen.add(id(o))
        pinned += gc.is_tracked(o)
        stack.extend(gc.get_referents(o))
    return pinned


def child(entry: str, warmup: int, worlds: int, every: int) -> dict[str, Any]:
    import gc
    import warnings

    warnings.simplefilter("ignore")  # torch's deprecation notices: not what is measured
    from _worlds import run

    from aiocoll._torch import pins_dtensor_specs

    pins_dtensor_specs()  # its probe pins a spec on a torch that leaks: before counting starts
    samples: list[tuple[int, float, int, int]] = []
    before: set[int] = set()
    start = time.monotonic()

    def after(i: int) -> None:
        nonlocal before
        done = i + 1
        if done >= warmup and ((done - warmup) % every == 0 or done == warmup + worlds):
            gc.collect()
            if not samples and pins_dtensor_specs():
                # their ids only: holding the objects would keep alive what the run lets go
                # (pytest's request of each test that ran, filled as it ran: about one
                # object a test). A new object at a dead one's address reads as old, so
                # the pins can only be undercounted: less is left out of the bound.
                before = {id(o) for o in gc.get_objects()}
            rss, count = _rss_mb(), len(gc.get_objects())  # before counting allocates
            samples.append((done - warmup, rss, count, _pinned_by_torch(before)))
            print(f"  {entry}: {done - warmup} worlds after warm-up, {samples[-1][1]:.0f} MB", file=sys.stderr)

    run(entry, warmup + worlds, after)
    return {"entry": entry, "samples": samples, "seconds": time.monotonic() - start}


def measure(entry: str, warmup: int, worlds: int, every: int, timeout: float) -> dict[str, Any]:
    """One entry point in a fresh interpreter."""
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    out = Path(name)
    cmd = [sys.executable, __file__, "--child", entry, "--warmup", str(warmup), "--worlds", str(worlds)]
    cmd += ["--every", str(every), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, timeout=timeout, check=False, stdout=subprocess.DEVNULL)
        text = out.read_text()
        data: dict[str, Any] = json.loads(text) if text else {"entry": entry, "samples": []}
        if proc.returncode != 0:
            data["error"] = f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        data = {"entry": entry, "samples": [], "error": f"ran past {timeout:g} s"}
    finally:
        out.unlink(missing_ok=True)
    return data


def report(results: list[dict[str, Any]], bound_objects: int, bound_mb: float) -> str:
    import torch

    lines = [
        f"torch {torch.__version__}, Python {sys.version.split()[0]}; counts after warm-up and at the end "
        f"(bound over the whole run: +{bound_objects} objects, +{bound_mb:g} MB, less what torch itself pins)",
        f"{'entry point':<18} {'worlds':>6} {'RSS MB':>15} {'objects':>19} {'per world':>19} {'torch pins':>10}"
        f" {'vs torch PG':>11}  {'bound':>5} {'s/world':>7}",
    ]
    growth: dict[str, float] = {}
    for r in results:
        s = r["samples"]
        if len(s) < 2:
            lines.append(f"{r['entry']:<18} {'-':>6}  {r.get('error', 'no samples')}")
            continue
        (_, _, obj0, _), (n, _, obj1, pinned) = s[0], s[-1]
        growth[r["entry"]] = (obj1 - obj0 - pinned) / n
    base = growth.get("torch threaded PG")
    for r in results:
        s = r["samples"]
        if len(s) < 2:
            continue
        (_, rss0, obj0, _), (n, rss1, obj1, pinned) = s[0], s[-1]
        per_obj, per_kb = (obj1 - obj0) / n, (rss1 - rss0) * 1024 / n
        ok = obj1 - obj0 - pinned <= bound_objects and rss1 - rss0 <= bound_mb
        ratio = (
            "-"
            if base is None or r["entry"] == "torch threaded PG"
            else f"{growth[r['entry']] / base:.3f}x"
            if base
            else "n/a"
        )
        seconds = r["seconds"] / max(n, 1)
        lines.append(
            f"{r['entry']:<18} {n:>6} {rss0:>7.0f}->{rss1:<7.0f} {obj0:>9}->{obj1:<9} "
            f"{per_obj:>7.1f} obj {per_kb:>6.1f} KB {pinned / n:>6.1f} obj {ratio:>11}  {'ok' if ok else 'OVER':>5}"
            f" {seconds:>7.2f}" + (f"  ({r['error']})" if "error" in r else "")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--entry", action="append", choices=ENTRY_POINTS, help="entry points (default: all)")
    parser.add_argument("--worlds", type=int, default=1000, help="worlds measured after warm-up")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--every", type=int, default=100, help="worlds between two samples")
    parser.add_argument("--bound-objects", type=int, default=2000)
    parser.add_argument("--bound-mb", type=float, default=25.0)
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per entry point")
    parser.add_argument("--json", help="also write the samples here")
    parser.add_argument("--child", choices=ENTRY_POINTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        Path(args.out).write_text(json.dumps(child(args.child, args.warmup, args.worlds, args.every)))
        return 0
    results = [measure(e, args.warmup, args.worlds, args.every, args.timeout) for e in args.entry or ENTRY_POINTS]
    print(report(results, args.bound_objects, args.bound_mb))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
