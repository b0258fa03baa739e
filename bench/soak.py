"""Soak: churn of pods (create, filter+bind, delete) at a target rate against real vgpu
processes, with kill -9 of NATS, of the leading allocator and of a node agent on a schedule.

Two allocator replicas, three node agents with their kubelet simulators, a nats-server with
its JetStream store on disk (the processes of tests/faults/harness.py); the API server is the
in-process fake and this script plays kube-scheduler. At the end it audits the pods the API
server has bound against JetStream KV and prints: pods placed, lost slices, double bookings,
p50/p99 placement latency, recovery per fault, RSS growth of the processes never killed.

    .venv/bin/python -m bench.soak --minutes 2        # smoke
    .venv/bin/python -m bench.soak                    # an hour at 50 pods/s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.report import write_section
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.simulators.apiserver import FakeApiServer
from tests.faults.harness import (
    Processes,
    audit,
    free_port,
    kill9,
    pod,
    schedule,
    wait_for_nodes,
    wait_until_ready,
)

NODES = ["n0", "n1", "n2"]
GPUS = 4
POD_MIB = 1000
LIVE_PODS = 300  # churn keeps about this many bound; 480 places in all
SETTLE_S = 75.0  # the allocator's bound for freeing a missed delete (60 s grace + 5 s round)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, workdir: Path, rate: float, minutes: float, fault_every_s: float) -> None:
        self.workdir = workdir
        self.rate = rate
        self.seconds = minutes * 60
        self.fault_every_s = fault_every_s
        self.latencies: list[float] = []
        self.placed = 0
        self.refused = 0
        self.recoveries: dict[str, list[float]] = {"nats": [], "allocator": [], "agent": []}
        self.live: list[dict[str, Any]] = []
        self.pending: set[asyncio.Task[None]] = set()  # pods being scheduled

    async def run(self) -> dict[str, Any]:
        nats = EmbeddedNats(store_dir=str(self.workdir / "jetstream")).start()
        api = FakeApiServer()
        await api.start()
        procs = Processes(self.workdir, nats.url, api.url)
        bus_box: list[Bus] = []
        try:
            return await self._run(nats, api, procs, bus_box)
        finally:
            for b in bus_box:
                await b.close()
            procs.close()
            await api.stop()
            nats.stop()

    async def _run(
        self, nats: EmbeddedNats, api: FakeApiServer, procs: Processes, bus_box: list[Bus]
    ) -> dict[str, Any]:
        ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.allocators = [procs.allocator(ports[i], f"replica-{i}", 2.0) for i in range(2)]
        for name in NODES:
            procs.node(name, gpus=GPUS, split_count=50)
        bus = await Bus.connect(nats.url, "soak-auditor")
        bus_box.append(bus)
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await wait_until_ready(http, self.urls[0])
            probe = await api.create_pod(pod("probe", POD_MIB))
            for url in self.urls:
                await wait_for_nodes(http, url, probe, NODES)
            await api.delete_pod("faults", "probe")
            watched = {
                f"agent-{n}": procs.nodes[n].agent for n in NODES[1:]
            }  # never killed: their RSS growth is the figure
            rss_start = {k: rss_kib(p.pid) for k, p in watched.items() if p is not None}
            churn = asyncio.create_task(self._churn(http, api))
            faults = asyncio.create_task(self._faults(http, nats, procs, api))
            await asyncio.sleep(self.seconds)
            churn.cancel()
            faults.cancel()
            for task in (churn, faults, *self.pending):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await asyncio.sleep(3)  # answers in flight land; the leader frees deleted pods
            rss_end = {k: rss_kib(p.pid) for k, p in watched.items() if p is not None}
            for url in self.urls:
                try:
                    await wait_until_ready(http, url, timeout_s=2)
                except AssertionError:
                    continue
            # The leader frees a deleted pod at once, and one whose delete it missed (it was
            # not leading, or the bus was away) within release_unbound_after_s (60 s) plus a
            # reconcile round: wait that long before counting what is left.
            deadline = time.monotonic() + SETTLE_S
            result = await audit(api, bus)
            while result.phantom and time.monotonic() < deadline:  # deletions being freed
                await asyncio.sleep(1)
                result = await audit(api, bus)
        return {
            "placed": self.placed,
            "refused": self.refused,
            "lost": len(result.lost),
            "double": len(result.duplicates) + len(result.over_booked),
            "stale": len(result.phantom),
            "bound_at_end": len(result.bound),
            "p50_ms": 1000 * statistics.median(self.latencies) if self.latencies else 0.0,
            "p99_ms": 1000 * _quantile(self.latencies, 0.99),
            "recoveries": self.recoveries,
            "rss": {k: (rss_start[k], rss_end.get(k, 0)) for k in rss_start},
        }

    async def _churn(self, http: aiohttp.ClientSession, api: FakeApiServer) -> None:
        serial = 0
        gate = asyncio.Semaphore(16)
        pending = self.pending

        async def one(p: dict[str, Any]) -> None:
            async with gate:
                started = time.monotonic()
                node = await schedule(http, random.sample(self.urls, 2), p, NODES)
                if node is None:
                    self.refused += 1
                    await api.delete_pod("faults", p["metadata"]["name"])
                    return
                self.latencies.append(time.monotonic() - started)
                self.placed += 1
                self.live.append(p)
                while len(self.live) > LIVE_PODS:
                    gone = self.live.pop(0)
                    await api.delete_pod("faults", gone["metadata"]["name"])

        next_at = time.monotonic()
        while True:
            next_at += 1 / self.rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            serial += 1
            p = await api.create_pod(pod(f"soak-{serial}", POD_MIB))
            task = asyncio.create_task(one(p))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def _faults(
        self, http: aiohttp.ClientSession, nats: EmbeddedNats, procs: Processes, api: FakeApiServer
    ) -> None:
        kinds = ["nats", "allocator", "agent"]
        for turn in range(10**6):
            await asyncio.sleep(self.fault_every_s)
            kind = kinds[turn % 3]
            if kind == "nats":
                assert nats.pid is not None
                os.kill(nats.pid, signal.SIGKILL)
                await nats.wait_exit()
                await asyncio.sleep(1.0)  # down a moment, as a supervisor's backoff
                await nats.start_async()
                started = time.monotonic()
                await self._until_a_bind(http, api)
                self.recoveries["nats"].append(time.monotonic() - started)
            elif kind == "allocator":
                leader = await self._leader(http)
                killed_at = kill9(self.allocators[leader])
                other = self.urls[1 - leader]
                await wait_until_ready(http, other)
                self.recoveries["allocator"].append(time.monotonic() - killed_at)
                port = int(self.urls[leader].rsplit(":", 1)[1])
                self.allocators[leader] = procs.allocator(port, f"replica-{leader}", 2.0)
            else:
                kill9(procs.nodes["n0"].agent)  # type: ignore[arg-type]
                procs.start_agent("n0", gpus=GPUS, split_count=50)
                started = time.monotonic()
                await self._until_agent_serves(http, "n0")
                self.recoveries["agent"].append(time.monotonic() - started)

    async def _leader(self, http: aiohttp.ClientSession) -> int:
        for _ in range(200):
            for i, url in enumerate(self.urls):
                try:
                    async with http.get(f"{url}/readyz") as response:
                        if response.status == 200:
                            return i
                except (aiohttp.ClientError, TimeoutError):
                    pass
            await asyncio.sleep(0.1)
        return 0

    async def _until_a_bind(self, http: aiohttp.ClientSession, api: FakeApiServer) -> None:
        """After NATS is back: until a fresh pod is bound (the whole path works again)."""
        for attempt in range(600):
            p = await api.create_pod(pod(f"nats-probe-{time.monotonic_ns()}-{attempt}", POD_MIB))
            node = await schedule(http, self.urls, p, NODES)
            await api.delete_pod("faults", p["metadata"]["name"])
            if node is not None:
                return
            await asyncio.sleep(0.1)

    async def _until_agent_serves(self, http: aiohttp.ClientSession, node: str) -> None:
        """Until the restarted agent's kubelet registration and inventory are back: its
        process listens on the device-plugin socket and the allocator hears the node."""
        socket_path = self.workdir / node / "kubelet" / "device-plugins" / "vgpu.sock"
        probe = pod("agent-probe", POD_MIB)
        probe["metadata"]["uid"] = "agent-probe"
        for _ in range(1200):
            if socket_path.exists():
                break
            await asyncio.sleep(0.05)
        for url in self.urls:
            try:
                await wait_for_nodes(http, url, probe, [node])
                return
            except AssertionError:
                continue


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _fmt(values: list[float]) -> str:
    if not values:
        return "none injected"
    return f"{len(values)}x, median {statistics.median(values):.2f} s, max {max(values):.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=50.0, help="pods created per second")
    parser.add_argument(
        "--fault-every", type=float, default=0.0,
        help="seconds between faults (default: 7 a run, at least 20 s apart)",
    )  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args()
    every = args.fault_every or max(20.0, args.minutes * 60 / 7)
    with tempfile.TemporaryDirectory(prefix="vgpu-soak-") as workdir:
        soak = Soak(Path(workdir), args.rate, args.minutes, every)
        figures = asyncio.run(soak.run())
    achieved = (figures["placed"] + figures["refused"]) / (args.minutes * 60)
    rss = ", ".join(
        f"{k} {a / 1024:.0f} -> {b / 1024:.0f} MiB" for k, (a, b) in figures["rss"].items()
    )
    lines = [
        "## Soak: churn with kill -9 faults (`bench/soak.py`)",
        "",
        f"Command: `.venv/bin/python -m bench.soak --minutes {args.minutes:g} --rate "
        f"{args.rate:g}`; a fault every {every:.0f} s in turn: kill -9 of the nats-server "
        "(restarted after 1 s on its store), of the leading allocator (of two; restarted), of "
        "node n0's agent (restarted). 3 nodes x 4 simulated A100-40GB, pods of 1000 MiB, about "
        f"{LIVE_PODS} kept bound (the oldest deleted). Machine: 2 CPU cores shared with other "
        "sessions (load average ~20), so the latencies are an upper bound.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| pods created | {figures['placed'] + figures['refused']} ({achieved:.1f}/s achieved) |",
        f"| pods placed | {figures['placed']} |",
        f"| pods not placed (no room, or every replica down) | {figures['refused']} |",
        f"| lost slices (bound, not booked) | {figures['lost']} |",
        f"| double bookings | {figures['double']} |",
        f"| bookings of deleted pods left {SETTLE_S:.0f} s after the churn | {figures['stale']} |",
        f"| placement latency p50 / p99 | {figures['p50_ms']:.0f} ms / "
        f"{figures['p99_ms']:.0f} ms |",
        f"| NATS kill -9: restart to first bind | {_fmt(figures['recoveries']['nats'])} |",
        f"| leader kill -9: to the other replica leading | "
        f"{_fmt(figures['recoveries']['allocator'])} |",
        f"| agent kill -9: restart to its node heard | {_fmt(figures['recoveries']['agent'])} |",
        f"| RSS of agents never killed (start -> end) | {rss} |",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_section("soak", report)


if __name__ == "__main__":
    main()
