"""``python -m aiocoll``: a short tour of what the library does, on a world of 4 ranks.

First a live view of the ranks training in lockstep (each line is what a rank is doing
right now: computing, or blocked in a collective waiting for the slower ones), then a
tour of the collectives, then two deliberate bugs reported at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time

import torch

import aiocoll
from aiocoll._engine._record import summarize_trace


async def _tour(comm: aiocoll.Comm) -> str:
    r = comm.rank
    t = torch.tensor([float(r + 1)])
    await comm.all_reduce(t)  # 1 + 2 + 3 + 4
    names = await comm.all_gather_object(f"rank{r}")
    # a ring over p2p: pass our rank to the right, receive from the left
    token = torch.tensor([r])
    got = torch.empty(1, dtype=torch.long)
    send = comm.send(token, (r + 1) % comm.world_size)
    await comm.recv(got, (r - 1) % comm.world_size)
    await send
    # split into evens and odds, then reduce inside each half
    half = await comm.split(color=r % 2, key=r)
    assert half is not None
    h = torch.tensor([r])
    await half.all_reduce(h, op=torch.distributed.ReduceOp.MAX)
    return (
        f"rank {r}: all_reduce={t.item():g}  all_gather_object={names}  "
        f"ring got {got.item()}  max in my half={h.item()}"
    )


async def _mismatch(comm: aiocoll.Comm) -> None:
    t = torch.ones(2)
    if comm.rank == 2:
        await comm.broadcast(t, src=0)  # a bug: everyone else reduces
    else:
        await comm.all_reduce(t)


async def _deadlock(comm: aiocoll.Comm) -> None:
    if comm.rank == 3:
        return  # a bug: rank 3 leaves before the barrier
    await comm.barrier()


STEPS = 8


def _view(stats: aiocoll.Statistics, steps: list[int]) -> list[str]:
    """One line per rank: its step and what it is doing."""
    lines = []
    for r in stats.ranks:
        bar = "#" * steps[r.rank] + "." * (STEPS - steps[r.rank])
        if r.state == "blocked":
            doing = f"waiting in {', '.join(r.waiting)} for ranks {list(r.waits_for)}"
        elif r.state == "running":
            doing = "computing"
        else:
            doing = r.state
        lines.append(f"  rank {r.rank} [{bar}] {doing}")
    return lines


async def _live(world: int, tty: bool) -> None:
    """Ranks of different speeds train in lockstep while a monitor shows each one's state."""
    steps = [0] * world
    comms: list[aiocoll.Comm] = []

    async def train(comm: aiocoll.Comm) -> None:
        comms.append(comm)
        grad = torch.ones(4)
        for step in range(STEPS):
            await asyncio.sleep(0.01 * (1 + comm.rank))  # compute: rank r is r+1 times slower
            await comm.all_reduce(grad)  # the fast ranks wait here for the slow ones
            steps[comm.rank] = step + 1

    finished = asyncio.Event()

    async def monitor() -> None:
        shown = 0
        while True:
            last = finished.is_set()
            if comms:
                lines = _view(comms[0].statistics(), steps)
                if tty and shown:
                    sys.stdout.write(f"\x1b[{shown}F")  # back to the first line of the last frame
                sys.stdout.write("".join(line + "\x1b[K\n" if tty else line + "\n" for line in lines))
                if not tty:
                    sys.stdout.write("\n")
                sys.stdout.flush()
                shown = len(lines)
            if last:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), 0.05 if tty else 0.15)

    # the monitor is not a rank: it only reads the world's state, and draws it once more
    # when the ranks are done
    watcher = asyncio.create_task(monitor())
    try:
        await aiocoll.spawn_async(train, world=world)
    finally:
        finished.set()
        await watcher


def trace_main(argv: list[str]) -> int:
    """``python -m aiocoll trace FILE``: summarise a trace written by ``spawn(..., trace=FILE)``."""
    parser = argparse.ArgumentParser(
        prog="python -m aiocoll trace",
        description="Summarise a trace written by aiocoll.spawn(..., trace=FILE): per op kind the count, "
        "total and max wait for peers, and the slowest rank.",
    )
    parser.add_argument("file", help="a trace JSON file")
    args = parser.parse_args(argv)
    try:
        with open(args.file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"python -m aiocoll trace: cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    print(summarize_trace(data))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trace"]:
        return trace_main(argv[1:])
    if argv[:1] == ["run"]:
        from aiocoll._cli._run import main as run_main

        return run_main(argv[1:], exit_when_interrupted=True)
    parser = argparse.ArgumentParser(
        prog="python -m aiocoll",
        description=__doc__,
        epilog=(
            "python -m aiocoll run [torchrun's options] script.py [args]: a torchrun script, every rank "
            "in this process (aiocoll run --help). "
            "python -m aiocoll trace FILE: summarise a trace written by spawn(..., trace=FILE)"
        ),
    )
    parser.add_argument("--world", type=int, default=4, help="number of ranks (default 4)")
    args = parser.parse_args(argv)
    w = args.world
    print(f"aiocoll {aiocoll.__version__}: {w} async ranks on one event loop\n")
    print("live: ranks of different speeds training in lockstep (rank r computes r+1 times longer)")
    asyncio.run(_live(w, sys.stdout.isatty()))
    print("\ncollectives, p2p and sub-groups:")
    for line in aiocoll.spawn(_tour, world=w):
        print("  " + line)

    for title, fn in (("a mismatched collective", _mismatch), ("a rank that leaves early", _deadlock)):
        print(f"\n{title}: reported at once, not after a timeout")
        start = time.perf_counter()
        try:
            aiocoll.spawn(fn, world=w)
        except aiocoll.AiocollError as e:
            took = time.perf_counter() - start
            print(f"  {type(e).__name__} after {took * 1000:.1f} ms:")
            for line in str(e).splitlines():
                print("    " + line)
        else:  # pragma: no cover - the demo's bugs are deliberate
            print("  (no error?)")
            return 1

    async def bench(comm: aiocoll.Comm) -> float:
        t = torch.zeros(1)
        for _ in range(100):
            await comm.all_reduce(t)
        start = time.perf_counter()
        for _ in range(2000):
            await comm.all_reduce(t)
        return (time.perf_counter() - start) / 2000

    per_op = aiocoll.spawn(bench, world=w)[0]
    print(f"\n1-element all_reduce, world {w}: {per_op * 1e6:.1f} µs per op")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
