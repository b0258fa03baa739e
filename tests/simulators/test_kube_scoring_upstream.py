"""The scheduler emulation's arithmetic against kube-scheduler's own recorded answers.

Each case is a scenario from kube-scheduler's unit tests, whose expected scores are what the
real plugins returned (kubernetes/kubernetes, pkg/scheduler/framework/plugins/noderesources/
least_allocated_test.go and balanced_allocation_test.go): the nodes' capacities, the pods
already bound, the incoming pod's containers, and the score per node. Quantities are given as
those tests give them (`st.MakeNode().Capacity({"cpu": "4000"})` is 4000 cores; `makeNode`
takes millicores), so the emulation reads them through the same quantity parsing as a pod
spec from the API server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from services.simulators.kube_scoring import (
    NodeInfo,
    PodDemand,
    balanced_allocation,
    balanced_allocation_skipped,
    least_allocated,
    pod_demand,
    quantity,
)

Requests = dict[str, str]


def spec(*containers: Requests) -> dict[str, Any]:
    """A pod with one container per requests map (st.MakePod().Req(...).Req(...))."""
    return {"spec": {"containers": [{"resources": {"requests": r}} for r in containers]}}


def nodes_with(
    capacity: dict[str, tuple[str, str]], bound: dict[str, list[dict[str, Any]]]
) -> dict[str, NodeInfo]:
    """Nodes by name from (cpu, memory) quantities, with their bound pods added."""
    found = {}
    for name, (cpu, memory) in capacity.items():
        info = NodeInfo(name, {"cpu": quantity(cpu, milli=True), "memory": quantity(memory)})
        for pod in bound.get(name, []):
            info.add(pod_demand(pod))
        found[name] = info
    return found


CPU_1_2 = spec({"cpu": "1000", "memory": "2000"}, {"cpu": "2000", "memory": "3000"})

LEAST_ALLOCATED = [
    ("nothing scheduled, nothing requested",
     spec(), {"node1": ("4000", "10000"), "node2": ("4000", "10000")}, {},
     {"node1": 100, "node2": 100}),
    ("nothing scheduled, resources requested, differently sized nodes",
     CPU_1_2, {"node1": ("4000", "10000"), "node2": ("6000", "10000")}, {},
     {"node1": 37, "node2": 50}),
    ("no resources requested, pods scheduled",
     spec(), {"node1": ("4000", "10000"), "node2": ("4000", "10000")},
     {"node1": [spec(), spec()], "node2": [spec(), spec()]},
     {"node1": 100, "node2": 100}),
    ("no resources requested, pods scheduled with resources",
     spec(), {"node1": ("10000", "20000"), "node2": ("10000", "20000")},
     {"node1": [spec({"cpu": "3000", "memory": "0"})] * 2,
      "node2": [spec({"cpu": "3000", "memory": "0"}), spec({"cpu": "3000", "memory": "5000"})]},
     {"node1": 70, "node2": 57}),
    ("resources requested, pods scheduled with resources",
     CPU_1_2, {"node1": ("10000", "20000"), "node2": ("10000", "20000")},
     {"node1": [spec({"cpu": "3000", "memory": "0"})],
      "node2": [spec({"cpu": "3000", "memory": "5000"})]},
     {"node1": 57, "node2": 45}),
    ("resources requested, pods scheduled with resources, differently sized nodes",
     CPU_1_2, {"node1": ("10000", "20000"), "node2": ("10000", "50000")},
     {"node1": [spec({"cpu": "3000", "memory": "0"})],
      "node2": [spec({"cpu": "3000", "memory": "5000"})]},
     {"node1": 57, "node2": 60}),
    ("requested resources exceed node capacity",
     spec({"cpu": "3000", "memory": "0"}), {"node1": ("4000", "10000"), "node2": ("4000", "10000")},
     {"node1": [spec({"cpu": "3000", "memory": "0"})],
      "node2": [spec({"cpu": "3000", "memory": "5000"})]},
     {"node1": 50, "node2": 25}),
    ("zero node resources, pods scheduled with resources",
     spec(), {"node1": ("0", "0"), "node2": ("0", "0")},
     {"node1": [spec({"cpu": "3000", "memory": "0"})],
      "node2": [spec({"cpu": "3000", "memory": "5000"})]},
     {"node1": 0, "node2": 0}),
]  # fmt: skip


# balanced_allocation_test.go's pods, in millicores (makeNode takes millicores too).
CPU_AND_MEMORY = spec({"cpu": "1000m", "memory": "2000"}, {"cpu": "2000m", "memory": "3000"})
CPU_ONLY = spec({"cpu": "1000m", "memory": "0"}, {"cpu": "2000m", "memory": "0"})

BALANCED = [
    ("nothing scheduled, resources requested, differently sized nodes",
     CPU_AND_MEMORY, {"node1": ("4", "10000"), "node2": ("6", "10000")}, {},
     {"node1": 87, "node2": 100}),
    ("resources requested, pods scheduled with resources",
     CPU_AND_MEMORY, {"node1": ("10", "20000"), "node2": ("10", "20000")},
     {"node1": [CPU_ONLY], "node2": [CPU_AND_MEMORY]},
     {"node1": 82, "node2": 95}),
    ("resources requested, pods scheduled with resources, differently sized nodes",
     CPU_AND_MEMORY, {"node1": ("10", "20000"), "node2": ("10", "50000")},
     {"node1": [CPU_ONLY], "node2": [CPU_AND_MEMORY]},
     {"node1": 82, "node2": 80}),
    ("requested resources at node capacity",
     CPU_ONLY, {"node1": ("6", "10000"), "node2": ("6", "10000")},
     {"node1": [CPU_ONLY], "node2": [CPU_AND_MEMORY]},
     {"node1": 50, "node2": 75}),
]  # fmt: skip


CASES = [("least_allocated", least_allocated, *case) for case in LEAST_ALLOCATED] + [
    ("balanced_allocation", balanced_allocation, *case) for case in BALANCED
]


@pytest.mark.parametrize(
    ("scorer", "incoming", "capacity", "bound", "expected"),
    [case[1:2] + case[3:] for case in CASES],
    ids=[f"{case[0]}: {case[2]}" for case in CASES],
)
def test_scores_as_kube_scheduler_recorded(
    scorer: Callable[[NodeInfo, PodDemand], int],
    incoming: dict[str, Any],
    capacity: dict[str, tuple[str, str]],
    bound: dict[str, list[dict[str, Any]]],
    expected: dict[str, int],
) -> None:
    demand = pod_demand(incoming)
    nodes = nodes_with(capacity, bound)
    assert {name: scorer(info, demand) for name, info in nodes.items()} == expected


def test_balanced_allocation_skips_a_best_effort_pod_as_kube_scheduler_does() -> None:
    # "nothing scheduled, nothing requested, skip in PreScore": PreScore answers Skip.
    assert balanced_allocation_skipped(pod_demand(spec()))
    assert balanced_allocation_skipped(pod_demand(spec({}, {})))
    # Any cpu or memory request brings the plugin back, as in every recorded case above.
    assert not any(balanced_allocation_skipped(pod_demand(case[1])) for case in BALANCED)
    assert not balanced_allocation_skipped(pod_demand(spec({"memory": "1Mi"})))
    assert not balanced_allocation_skipped(pod_demand(spec({"cpu": "10m"})))
