"""kube-scheduler's default filter and scoring arithmetic (kube-scheduler-scoring.md sections
3, 4, 6, 7, 8), worked by hand: integer truncation, the non-zero defaults, how extender
scores add, how many nodes a cycle examines, and the seeded uniform tie-break."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.common.quantity import QuantityError
from services.simulators.kube_scoring import (
    DEFAULT_MEMORY,
    DEFAULT_MILLI_CPU,
    NodeInfo,
    PodDemand,
    balanced_allocation,
    extender_total,
    fit_problem,
    least_allocated,
    num_feasible_nodes_to_find,
    pod_demand,
    quantity,
    select_host,
)

GI = 1024**3


def pod(*containers: dict[str, str], init: tuple[dict[str, str], ...] = ()) -> dict:
    def c(requests: dict[str, str]) -> dict:
        return {"name": "c", "resources": {"requests": requests}}

    return {"spec": {"containers": [c(r) for r in containers],
                     "initContainers": [c(r) for r in init]}}  # fmt: skip


def node(cpu: int = 4000, memory: int = 8 * GI, **allocatable: int) -> NodeInfo:
    return NodeInfo("n", {"cpu": cpu, "memory": memory, "pods": 110, **allocatable})


@pytest.mark.parametrize(
    ("text", "milli", "expected"),
    [("4k", False, 4000), ("1Ki", False, 1024), ("500m", True, 500), ("0.5", True, 500),
     ("1e3", False, 1000), ("16384Mi", False, 16384 * 2**20), ("2", True, 2000),
     ("1m", False, 1), ("100", False, 100)],
)  # fmt: skip
def test_quantities_as_the_scheduler_reads_them(text: str, milli: bool, expected: int) -> None:
    assert quantity(text, milli=milli) == expected


@pytest.mark.parametrize("text", ["", "abc", "1.5.5", "4 k", "1e3Mi", "5X"])
def test_malformed_quantities_are_refused(text: str) -> None:
    with pytest.raises(QuantityError):
        quantity(text)


def test_pod_demand_sums_apps_raises_to_init_and_defaults_only_for_scoring() -> None:
    demand = pod_demand(pod({"cpu": "1", "memory": "1Gi"}, {"nvidia.com/gpu": "1"},
                            init=({"cpu": "3", "memory": "512Mi"},)))  # fmt: skip
    assert demand.requests == {"cpu": 3000, "memory": GI, "nvidia.com/gpu": 1}
    # The second container asks no cpu/memory: 100m and 200 MiB count for scoring only.
    assert demand.non_zero_cpu == 3000  # max(1000 + 100, init 3000)
    assert demand.non_zero_memory == GI + DEFAULT_MEMORY
    assert pod_demand(pod({})).non_zero_cpu == DEFAULT_MILLI_CPU


def test_least_allocated_truncates_per_resource_then_averages() -> None:
    info = node(cpu=4000, memory=10 * GI)
    info.non_zero_cpu, info.non_zero_memory = 2000, 0
    demand = PodDemand({"cpu": 1000, "memory": GI}, 1000, GI)
    # cpu: (4000 - 3000) * 100 / 4000 = 25; memory: (10 - 1) * 100 / 10 = 90; (25 + 90) / 2
    assert least_allocated(info, demand) == 57
    # More than allocatable scores 0 for that resource.
    assert least_allocated(info, PodDemand({}, 5000, GI)) == 45


def test_balanced_allocation_uses_actual_requests() -> None:
    info = node(cpu=4000, memory=8 * GI)
    info.requested = {"cpu": 1000, "memory": GI}
    demand = PodDemand({"cpu": 1000, "memory": GI}, 1000, GI)
    # fractions 0.5 and 0.25: std = 0.125, score int(87.5) = 87
    assert balanced_allocation(info, demand) == 87
    assert balanced_allocation(info, PodDemand({"cpu": 1000, "memory": 3 * GI}, 0, 0)) == 100


def test_fit_filter_checks_requests_pods_and_skips_ignored_resources() -> None:
    info = node(cpu=4000, **{"nvidia.com/gpu": 10})
    info.requested = {"cpu": 3500, "nvidia.com/gpu": 10}
    assert fit_problem(info, PodDemand({"cpu": 500}, 500, 0)) is None
    assert fit_problem(info, PodDemand({"cpu": 501}, 501, 0)) == "Insufficient cpu"
    gpu = PodDemand({"nvidia.com/gpu": 1}, 0, 0)
    assert fit_problem(info, gpu) == "Insufficient nvidia.com/gpu"
    assert fit_problem(info, gpu, ignored={"nvidia.com/gpu"}) is None
    assert fit_problem(info, PodDemand({"nvidia.com/gpumem": 4000}, 0, 0)) == (
        "Insufficient nvidia.com/gpumem"  # no node advertises it: managed by the extender
    )
    info.pods = 110
    assert fit_problem(info, PodDemand({}, 0, 0)) == "Too many pods"


@pytest.mark.parametrize(
    ("nodes", "percentage", "expected"),
    [(50, 0, 50), (500, 0, 230), (1000, 0, 420), (1213, 0, 497), (3000, 0, 780),
     (5000, 0, 500), (6000, 0, 300), (1213, 100, 1213), (1213, 10, 121), (1213, 1, 100)],
)  # fmt: skip
def test_nodes_examined_per_cycle(nodes: int, percentage: int, expected: int) -> None:
    assert num_feasible_nodes_to_find(nodes, percentage) == expected


def test_extender_scores_add_ten_times_weight() -> None:
    assert extender_total({"a": 7, "b": 0}, weight=2) == {"a": 140, "b": 0}


def test_select_host_highest_total_and_seeded_uniform_ties() -> None:
    assert select_host([("a", 10), ("b", 30), ("c", 20)], random.Random(0)) == "b"
    tied = [("a", 5), ("b", 9), ("c", 9), ("d", 9)]
    rng = random.Random(7)
    picks = Counter(select_host(tied, rng) for _ in range(3000))
    assert set(picks) == {"b", "c", "d"}
    assert all(850 < count < 1150 for count in picks.values())  # about 1000 each
    first, second = random.Random(7), random.Random(7)
    assert [select_host(tied, first) for _ in range(20)] == [
        select_host(tied, second) for _ in range(20)
    ]


def test_scheduler_config_reads_extenders_interest_and_ignored_resources() -> None:
    from services.simulators.scheduler import SchedulerConfig

    document = {
        "profiles": [{"schedulerName": "vgpu-scheduler"}],
        "extenders": [
            {"urlPrefix": "http://x/scheduler/", "filterVerb": "filter", "bindVerb": "bind",
             "managedResources": [{"name": "nvidia.com/gpu", "ignoredByScheduler": False},
                                  {"name": "nvidia.com/gpumem", "ignoredByScheduler": True}]},
            {"urlPrefix": "http://x/scheduler", "prioritizeVerb": "prioritize", "weight": 60,
             "httpTimeout": "2s"},
        ],
    }  # fmt: skip
    config = SchedulerConfig.from_document(document, extender_url="http://allocator/scheduler")
    gpu_only, everyone = config.extenders
    assert gpu_only.url == everyone.url == "http://allocator/scheduler"
    assert (gpu_only.filter_verb, gpu_only.bind_verb, gpu_only.prioritize_verb) == (
        "filter", "bind", "")  # fmt: skip
    assert (everyone.weight, everyone.timeout_s) == (60, 2.0)
    assert config.ignored_resources == {"nvidia.com/gpumem"}
    assert config.percentage_of_nodes_to_score == 0  # unset: adaptive
    gpu_pod = {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    cpu_pod = {"spec": {"containers": [{"resources": {"requests": {"cpu": "1"}}}]}}
    assert gpu_only.interested(gpu_pod) and not gpu_only.interested(cpu_pod)
    assert everyone.interested(gpu_pod) and everyone.interested(cpu_pod)
