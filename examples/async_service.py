"""An async service that batches requests and all-reduces its statistics, staying responsive.

Each of four ranks is a small inference service on the shared event loop: a simulated
client puts requests on an ``asyncio.Queue`` at jittered intervals (some ranks busier than
others), a handler serves them in batches of up to 8, and every 5 batches it hands its
counters (requests served, latency sum) to a reporter, which combines them across ranks
with ``await comm.all_reduce(...)`` while the handler keeps serving. A ``health`` task
measures how late the loop wakes a 1 ms sleep, and the script checks that the worst lag
stays small. Ranks finish at different times: a rank whose client is done keeps joining
the statistics all_reduce (with a "done" flag) until every rank is done, so all ranks make
the same calls. The service runs inside an existing loop with ``aiocoll.spawn_async`` and
leaves no task behind.

Run: python examples/async_service.py
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

import aiocoll

WORLD = 4
REQUESTS = 100  # per rank
MAX_BATCH = 8
SYNC_EVERY = 5  # batches
MAX_LAG = 0.050  # seconds: generous, for a loaded machine


@dataclass
class Request:
    x: torch.Tensor
    arrived: float


async def client(comm: aiocoll.Comm, queue: asyncio.Queue[Request | None]) -> None:
    """Requests at jittered intervals; higher ranks are quieter. None closes the queue."""
    loop = asyncio.get_running_loop()
    gen = aiocoll.rank_generator(seed=3)
    gaps = 0.002 * (1 + comm.rank / 2) * 2 * torch.rand(REQUESTS, generator=gen)
    for gap in gaps.tolist():
        await asyncio.sleep(gap)
        queue.put_nowait(Request(torch.randn(16, generator=gen), loop.time()))
    queue.put_nowait(None)


async def handler(queue: asyncio.Queue[Request | None], stats: asyncio.Queue[tuple[float, float, float]]) -> None:
    """Serve requests in batches; every SYNC_EVERY batches, pass the counters on."""
    loop = asyncio.get_running_loop()
    model = torch.nn.Linear(16, 4)
    served, latency, batches = 0, 0.0, 0
    open_ = True
    while open_:
        first = await queue.get()
        if first is None:
            break
        batch = [first]
        while len(batch) < MAX_BATCH and not queue.empty():
            req = queue.get_nowait()
            if req is None:
                open_ = False
                break
            batch.append(req)
        with torch.no_grad():  # grad mode is shared by all ranks: no await inside
            model(torch.stack([r.x for r in batch]))
        await asyncio.sleep(0.002)  # e.g. writing the responses out
        now = loop.time()
        served += len(batch)
        latency += sum(now - r.arrived for r in batch)
        batches += 1
        if batches % SYNC_EVERY == 0:
            stats.put_nowait((served, latency, 0.0))
    stats.put_nowait((served, latency, 1.0))  # done


async def report(comm: aiocoll.Comm, stats: asyncio.Queue[tuple[float, float, float]]) -> list[list[float]]:
    """Combine the counters of all ranks until every rank is done; returns each round's totals."""
    rounds: list[list[float]] = []
    mine = (0.0, 0.0, 0.0)
    while True:
        if mine[2] == 0.0:  # still serving: wait for the handler's next counters
            mine = await stats.get()
        totals = torch.tensor(mine, dtype=torch.float64)
        await comm.all_reduce(totals)  # the handler keeps serving meanwhile
        rounds.append(totals.tolist())
        if totals[2] == comm.world_size:
            return rounds


async def health(stop: asyncio.Event) -> float:
    """The worst delay, in seconds, with which the loop woke a 1 ms sleep."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(0.001)
        worst = max(worst, loop.time() - t0 - 0.001)
    return worst


async def serve(comm: aiocoll.Comm) -> tuple[list[list[float]], float]:
    queue: asyncio.Queue[Request | None] = asyncio.Queue()
    stats: asyncio.Queue[tuple[float, float, float]] = asyncio.Queue()
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(client(comm, queue))
        tg.create_task(handler(queue, stats))
        lag = tg.create_task(health(stop))
        rounds = await report(comm, stats)
        stop.set()
    return rounds, lag.result()


async def main() -> None:
    results = await aiocoll.spawn_async(serve, world=WORLD)
    assert asyncio.all_tasks() == {asyncio.current_task()}  # nothing left running

    rounds = results[0][0]
    assert all(r[0] == rounds for r in results)  # every rank saw the same totals
    served = [r[0] for r in rounds]
    assert served == sorted(served)
    final_served, final_latency, _ = rounds[-1]
    assert final_served == WORLD * REQUESTS
    worst = max(lag for _, lag in results)
    assert worst < MAX_LAG, f"the loop stalled for {worst * 1000:.1f} ms"
    print(f"{WORLD} ranks served {final_served:.0f} requests; {len(rounds)} statistics all_reduces")
    print(f"mean latency {final_latency / final_served * 1000:.1f} ms; worst loop lag {worst * 1000:.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
