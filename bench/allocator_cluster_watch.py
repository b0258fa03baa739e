"""The allocator's Node + bound-pod watch at the openb trace's scale, through the real client.

An in-process API server (services/simulators/apiserver.py, real HTTP) holds the openb GPU
nodes (1,213, with their CPU and memory as allocatable) and the trace's pods bound to random
nodes that can hold them. A real allocator in Kubernetes mode (embedded nats-server) starts
against it: the figure "list" is from start to every pod counted. Then pods churn through
the watch: a share of the pods end (phase Succeeded) while as many new ones are created
bound; "watch" is from the first change to the last one counted, and the events per second.
The counts are checked against the sum of the pods' requests on every node.

    .venv/bin/python -m bench.allocator_cluster_watch [--churn 2000] [--traces DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import write_section
from services.allocator import Allocator, AllocatorSettings
from services.common.embedded_nats import EmbeddedNats
from services.simulate.replay import inventories
from services.simulate.trace import TraceNode, TracePod, read_nodes, read_pods
from services.simulators.apiserver import FakeApiServer

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"
NODES = "openb_node_list_gpu_node.csv"
PODS = "openb_pod_list_default.csv"


def node_object(node: TraceNode) -> dict[str, str]:
    return {"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi", "pods": "110"}


def pod_object(pod: TracePod, index: int, node: str) -> dict[str, Any]:
    resources = {"requests": {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"p{index}", "namespace": "trace"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "resources": resources}]},
        "status": {"phase": "Running"},
    }


def place(pods: list[TracePod], nodes: list[TraceNode], rng: random.Random) -> list[str]:
    """A node with room (CPU, memory, pods) for each pod, picked at random: the bound state."""
    free = {n.name: [n.cpu_milli, n.memory_mib, 110] for n in nodes}
    names = [n.name for n in nodes]
    chosen = []
    for pod in pods:
        for _ in range(50):
            name = rng.choice(names)
            room = free[name]
            if room[0] >= pod.cpu_milli and room[1] >= pod.memory_mib and room[2] > 0:
                room[0] -= pod.cpu_milli
                room[1] -= pod.memory_mib
                room[2] -= 1
                chosen.append(name)
                break
        else:
            chosen.append("")
    return chosen


def used_cpu(allocator: Allocator) -> dict[str, int]:
    return {s.name: s.used_cpu_milli for s in allocator.cluster.states() if s.used_cpu_milli}


async def run(traces: Path, churn: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    nodes, pods = read_nodes(traces / NODES), read_pods(traces / PODS)
    where = place(pods, nodes, rng)
    api = FakeApiServer(keep_changes=4 * churn + 1000)
    await api.start()
    nats = EmbeddedNats().start()
    expected: dict[str, int] = {}
    bound: list[int] = []
    try:
        for node in nodes:
            api.add_node(node.name, allocatable=node_object(node))
        for index, (pod, node) in enumerate(zip(pods, where, strict=True)):
            if node:
                await api.create_pod(pod_object(pod, index, node))
                expected[node] = expected.get(node, 0) + pod.cpu_milli
                bound.append(index)
        allocator = Allocator(
            AllocatorSettings(nats_url=nats.url, http_port=0, cluster="kubernetes",
                              kube_api_url=api.url, state_bucket="", lease_bucket="",
                              cluster_sync_timeout_s=60, log_level="warning")
        )  # fmt: skip
        started = time.perf_counter()
        await allocator.start()
        for inventory in inventories(nodes):  # as the agents would publish them
            allocator.engine.on_inventory(inventory)
        listed_s = time.perf_counter() - started
        assert len(allocator.ledger.host) == len(bound), (len(allocator.ledger.host), len(bound))
        assert used_cpu(allocator) == expected

        ending = rng.sample(bound, min(churn, len(bound)))
        began = time.perf_counter()
        for index in ending:
            await api.set_phase("trace", f"p{index}", "Succeeded")
            expected[where[index]] -= pods[index].cpu_milli
        for extra in range(len(ending)):
            pod = pods[ending[extra]]
            node = where[ending[extra]]
            await api.create_pod(pod_object(pod, len(pods) + extra, node))
            expected[node] += pod.cpu_milli
        expected = {n: cpu for n, cpu in expected.items() if cpu}
        events = 2 * len(ending)
        while used_cpu(allocator) != expected:
            await asyncio.sleep(0.01)
            if time.perf_counter() - began > 120:
                raise AssertionError("the watch did not catch up within 120 s")
        watch_s = time.perf_counter() - began
        await allocator.stop()
    finally:
        nats.stop()
        await api.stop()
    return {
        "nodes": len(nodes),
        "pods": len(bound),
        "list_s": listed_s,
        "events": events,
        "watch_s": watch_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--churn", type=int, default=2000, help="pods ended and created")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces", type=Path, default=TRACES, help="the openb trace folder")
    parser.add_argument("--no-write", action="store_true", help="do not touch benchmarks.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not (args.traces / NODES).exists() or not (args.traces / PODS).exists():
        sys.exit(f"the openb trace is not at {args.traces} (give --traces)")
    figures = asyncio.run(run(args.traces, args.churn, args.seed))
    line = (
        f"| {figures['nodes']} | {figures['pods']} | {figures['list_s']:.2f} s "
        f"| {figures['events']} | {figures['watch_s']:.2f} s "
        f"| {figures['events'] / figures['watch_s']:.0f} |"
    )
    print(line)
    if not args.no_write:
        write_section(
            "allocator-cluster-watch",
            "## Allocator: Node and bound-pod watch (openb scale)\n\n"
            "`.venv/bin/python -m bench.allocator_cluster_watch` "
            "(bench/allocator_cluster_watch.py): the openb GPU nodes as Node objects and the "
            "default trace's pods bound to them, "
            "in the in-process API server over real HTTP; a real allocator in Kubernetes mode "
            "lists and watches them through the `kubernetes` client. *list* = allocator start "
            "to every pod counted (includes NATS, the Node list and the bound-pod list); "
            "*watch* = pods ending and new pods bound, first change to the last one counted. "
            "Every node's counted CPU is checked against the sum of its pods' requests. On "
            "this shared 2-core VM, figures vary by up to 2x.\n\n"
            "| nodes | pods | list | watch events | watch | events/s |\n"
            "|---|---|---|---|---|---|\n" + line,
        )


if __name__ == "__main__":
    main()
