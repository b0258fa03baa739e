"""Soak: churn of pods (create, filter+bind, delete) at a target rate against real vgpu
processes, with kill -9 of NATS, of the leading allocator and of a node agent on a schedule.

Two allocator replicas, three node agents with their kubelet simulators, a nats-server with
its JetStream store on disk (the processes of bench/fault_rig.py, which tests/faults uses
too); the API server is the in-process fake and this script plays kube-scheduler. At the end
it audits the pods the API server has bound against JetStream KV and prints: pods placed,
pods refused for lack of room, placements that failed inside a fault's window (and outside
any: there should be none), lost slices, double bookings, bookings of deleted pods left,
p50/p99 placement latency, recovery per fault, RSS growth of the processes never killed.

    .venv/bin/python -m bench.soak                    # 2 minutes at 50 pods/s (smoke)
    .venv/bin/python -m bench.soak --hour             # an hour at 50 pods/s
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.fault_rig import (
    Processes,
    audit,
    free_port,
    kill9,
    place,
    pod,
    schedule,
    wait_alive,
    wait_for_nodes,
    wait_until_ready,
)
from bench.report import write_section
from services.common.bus import Bus
from services.common.embedded_nats import EmbeddedNats
from services.common.processes import process_alive
from services.simulators.apiserver import FakeApiServer

NODES = ["n0", "n1", "n2"]
GPUS = 4
POD_MIB = 1000
LIVE_PODS = 300  # churn keeps about this many bound; 480 places in all
SETTLE_S = 75.0  # the allocator's bound for freeing a missed delete (60 s grace + 5 s round)
WINDOW_MARGIN_S = 2.0  # a fault's window: from the kill to its recovery, plus this
FAULTS = ("nats", "allocator", "agent")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass
class Window:
    """From a kill to the fault's recovery (end 0: not recovered yet)."""

    fault: str
    start: float
    end: float = 0.0

    def overlaps(self, start: float, end: float) -> bool:
        closed = self.end + WINDOW_MARGIN_S if self.end else float("inf")
        return start <= closed and end >= self.start


class Soak:
    def __init__(self, workdir: Path, rate: float, minutes: float, fault_every_s: float) -> None:
        self.workdir = workdir
        self.rate = rate
        self.seconds = minutes * 60
        self.fault_every_s = fault_every_s
        self.latencies: list[float] = []
        self.placed = 0
        self.no_room = 0  # a replica judged every node and none had room: not a failure
        self.failed: dict[str, int] = {fault: 0 for fault in FAULTS}  # inside that window
        self.failed_outside = 0  # failures inside no fault's window
        self.errors: dict[str, int] = {}  # the last error of failures outside any window
        self.windows: list[Window] = []
        self.recoveries: dict[str, list[float]] = {fault: [] for fault in FAULTS}
        self.live: list[dict[str, Any]] = []
        self.deleted_at: dict[str, float] = {}  # uid -> when the churn deleted its pod
        self.deleted_wall: dict[str, float] = {}  # the same, Unix time (bookings carry it)
        self.pending: set[asyncio.Task[None]] = set()  # pods being scheduled
        self.log_level = "warning"

    async def run(self) -> dict[str, Any]:
        nats = EmbeddedNats(store_dir=str(self.workdir / "jetstream")).start()
        api = FakeApiServer()
        await api.start()
        procs = Processes(self.workdir, nats.url, api.url, log_level=self.log_level)
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
            # Either replica may take the lease first; none within a minute is an error.
            await wait_until_ready(http, self.urls[await self._leader(http, timeout_s=60)], 1)
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
            if nats.pid is None or not process_alive(nats.pid):
                await nats.start_async()  # the run ended inside a NATS fault: end it first
            ended_at = time.monotonic()
            await asyncio.sleep(3)  # answers in flight land; the leader frees deleted pods
            rss_end = {k: rss_kib(p.pid) for k, p in watched.items() if p is not None}
            for url in self.urls:
                try:
                    await wait_until_ready(http, url, timeout_s=2)
                except AssertionError:
                    continue
            first = await audit(api, bus)
            stale_first = self._explain(first.phantom, first.booked_at)
            # A delete no leader heard is freed by the leader's reconciliation within
            # release_unbound_after_s (60 s) plus a round: wait that long before counting.
            deadline = time.monotonic() + SETTLE_S
            result = first
            while result.phantom and time.monotonic() < deadline:
                await asyncio.sleep(1)
                result = await audit(api, bus)
        return {
            "placed": self.placed,
            "no_room": self.no_room,
            "failed": dict(self.failed),
            "failed_outside": self.failed_outside,
            "errors": dict(self.errors),
            "lost": len(result.lost),
            "double": len(result.duplicates) + len(result.over_booked),
            "stale_first": stale_first,
            "stale": len(result.phantom),
            "settled_s": time.monotonic() - ended_at,
            "bound_at_end": len(result.bound),
            "p50_ms": 1000 * statistics.median(self.latencies) if self.latencies else 0.0,
            "p99_ms": 1000 * _quantile(self.latencies, 0.99),
            "recoveries": self.recoveries,
            "rss": {k: (rss_start[k], rss_end.get(k, 0)) for k in rss_start},
        }

    def _explain(self, phantom: set[str], booked_at: dict[str, float]) -> dict[str, int]:
        """Bookings of pods the API server no longer has, by what was going on when the
        churn deleted the pod, and whether the booking was made after the delete."""
        why: dict[str, int] = {}
        for uid in phantom:
            at = self.deleted_at.get(uid)
            if at is None:
                reason = "not deleted by the churn"
            else:
                inside = [w.fault for w in self.windows if w.overlaps(at, at)]
                reason = f"deleted during a {inside[0]} fault" if inside else "deleted, no fault"
                if booked_at.get(uid, 0.0) > self.deleted_wall[uid]:
                    reason += ", booked after the delete"
            why[reason] = why.get(reason, 0) + 1
        return why

    def _fault_of(self, start: float, end: float) -> str | None:
        for window in self.windows:
            if window.overlaps(start, end):
                return window.fault
        return None

    async def _delete(self, api: FakeApiServer, p: dict[str, Any]) -> None:
        self.deleted_at[p["metadata"]["uid"]] = time.monotonic()
        self.deleted_wall[p["metadata"]["uid"]] = time.time()
        await api.delete_pod("faults", p["metadata"]["name"])

    async def _churn(self, http: aiohttp.ClientSession, api: FakeApiServer) -> None:
        serial = 0
        gate = asyncio.Semaphore(16)
        pending = self.pending

        async def one(p: dict[str, Any]) -> None:
            async with gate:
                started = time.monotonic()
                outcome = await place(http, random.sample(self.urls, 2), p, NODES)
                if outcome.node is None:
                    fault = self._fault_of(started, time.monotonic())
                    if outcome.no_room:
                        self.no_room += 1
                    elif fault is not None:
                        self.failed[fault] += 1
                    else:
                        self.failed_outside += 1
                        self.errors[outcome.error] = self.errors.get(outcome.error, 0) + 1
                    await self._delete(api, p)  # the scheduler gives it up
                    return
                self.latencies.append(time.monotonic() - started)
                self.placed += 1
                self.live.append(p)
                while len(self.live) > LIVE_PODS:
                    await self._delete(api, self.live.pop(0))

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
        for turn in range(10**6):
            await asyncio.sleep(self.fault_every_s)
            kind = FAULTS[turn % len(FAULTS)]
            window = Window(kind, time.monotonic())
            self.windows.append(window)
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
                with contextlib.suppress(AssertionError):  # the window ends when it serves
                    await wait_alive(http, self.urls[leader], timeout_s=60)
            else:
                kill9(procs.nodes["n0"].agent)  # type: ignore[arg-type]
                procs.start_agent("n0", gpus=GPUS, split_count=50)
                started = time.monotonic()
                await self._until_agent_serves(http, "n0")
                self.recoveries["agent"].append(time.monotonic() - started)
            window.end = time.monotonic()

    async def _leader(self, http: aiohttp.ClientSession, timeout_s: float = 20) -> int:
        """The replica that leads (answers /readyz 200); replica 0 if none within the time."""
        for _ in range(int(timeout_s * 10)):
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


def _counts(counts: dict[str, int]) -> str:
    shown = ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items()) if n)
    return shown or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="length of the churn")
    parser.add_argument("--rate", type=float, default=50.0, help="pods created per second")
    parser.add_argument(
        "--hour", action="store_true",
        help="the long run: 60 minutes at 50 pods/s (overrides --minutes and --rate)",
    )  # fmt: skip
    parser.add_argument(
        "--fault-every", type=float, default=0.0,
        help="seconds between faults (default: 7 a run, at least 20 s apart)",
    )  # fmt: skip
    parser.add_argument(
        "--keep", metavar="DIR", default="",
        help="run in DIR and keep it (each process's log, the JetStream store)",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default="warning",
        help="of the vgpu processes (with --keep, read their logs after the run)",
    )  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args()
    if args.hour:
        args.minutes, args.rate = 60.0, 50.0
    every = args.fault_every or max(20.0, args.minutes * 60 / 7)
    with contextlib.ExitStack() as stack:
        if args.keep:
            workdir = Path(args.keep)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vgpu-soak-")))
        soak = Soak(workdir, args.rate, args.minutes, every)
        soak.log_level = args.log_level
        figures = asyncio.run(soak.run())
        figures["load"] = os.getloadavg()[2]  # over the last 15 minutes
    report = render(figures, args.minutes, args.rate, every, "--hour" if args.hour else "")
    print(report)
    if not args.no_write:
        write_section("soak", report)


def render(figures: dict[str, Any], minutes: float, rate: float, every: float, flag: str) -> str:
    failed = sum(figures["failed"].values())
    created = figures["placed"] + figures["no_room"] + failed + figures["failed_outside"]
    achieved = created / (minutes * 60)
    rss = ", ".join(
        f"{k} {a / 1024:.0f} -> {b / 1024:.0f} MiB" for k, (a, b) in figures["rss"].items()
    )
    command = flag or f"--minutes {minutes:g} --rate {rate:g}"
    outside = str(figures["failed_outside"])
    if figures["errors"]:
        outside += f" ({_counts(figures['errors'])})"
    lines = [
        "## Soak: churn with kill -9 faults (`bench/soak.py`)",
        "",
        f"Command: `.venv/bin/python -m bench.soak {command}`; a fault every {every:.0f} s in "
        "turn: kill -9 of the nats-server (restarted after 1 s on its store), of the leading "
        "allocator (of two; restarted), of node n0's agent (restarted). 3 nodes x 4 simulated "
        f"A100-40GB, pods of 1000 MiB, about {LIVE_PODS} kept bound (the oldest deleted), so "
        "some pods find no room by design. A fault's window runs from the kill to its "
        f"recovery plus {WINDOW_MARGIN_S:g} s. Machine: 2 CPU cores shared with other sessions "
        f"(15-minute load average {figures['load']:.0f} at the end), so the latencies are an "
        "upper bound.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| pods created | {created} ({achieved:.1f}/s achieved of {rate:g}/s) |",
        f"| pods placed | {figures['placed']} |",
        f"| refused for lack of room (every node judged, none had room) | {figures['no_room']} |",
        f"| not placed inside a fault's window | {failed} ({_counts(figures['failed'])}) |",
        f"| not placed outside any fault's window | {outside} |",
        f"| lost slices (bound, not booked) | {figures['lost']} |",
        f"| double bookings | {figures['double']} |",
        f"| bookings of deleted pods 3 s after the churn | "
        f"{sum(figures['stale_first'].values())} ({_counts(figures['stale_first'])}) |",
        f"| bookings of deleted pods at the end ({figures['settled_s']:.0f} s after) | "
        f"{figures['stale']} |",
        f"| placement latency p50 / p99 | {figures['p50_ms']:.0f} ms / "
        f"{figures['p99_ms']:.0f} ms |",
        f"| NATS kill -9: restart to first bind | {_fmt(figures['recoveries']['nats'])} |",
        f"| leader kill -9: to the other replica leading | "
        f"{_fmt(figures['recoveries']['allocator'])} |",
        f"| agent kill -9: restart to its node heard | {_fmt(figures['recoveries']['agent'])} |",
        f"| RSS of agents never killed (start -> end) | {rss} |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
