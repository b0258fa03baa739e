"""The picture's own rules, on a hand-driven clock: freshness, ageing, change tracking."""

from __future__ import annotations

import pytest

from services.common.schemas import (
    AllocationEvent,
    ContainerRequest,
    GpuDevice,
    NodeInventory,
    PendingPod,
)
from services.metrics.picture import ClusterPicture, EventRejected
from services.metrics.views import cluster_view, pending_summary
from tests.metrics.helpers import ALLOCATION, CONTAINER_USAGE, INVENTORY, USAGE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def picture(clock: Clock) -> ClusterPicture:
    return ClusterPicture(stale_after_s=10.0, pending_ttl_s=60.0, clock=clock)


def test_a_repeated_heartbeat_changes_nothing_but_going_silent_does(
    picture: ClusterPicture, clock: Clock
) -> None:
    picture.on_inventory(INVENTORY)
    assert picture.take_changes().nodes == {"node-a"}
    clock.now += 5
    picture.on_inventory(INVENTORY)
    picture.sweep()
    assert not picture.take_changes()
    clock.now += 10.5
    picture.sweep()
    assert picture.take_changes().nodes == {"node-a"}
    assert not picture.is_up("node-a")
    picture.sweep()
    assert not picture.take_changes()  # reported once
    picture.on_inventory(INVENTORY)
    assert picture.take_changes().nodes == {"node-a"}


def test_usage_and_container_reports_age_out(picture: ClusterPicture, clock: Clock) -> None:
    picture.on_inventory(INVENTORY)
    picture.on_usage(USAGE)
    picture.on_allocation(AllocationEvent(kind="bound", allocation=ALLOCATION))
    picture.on_container_usage(CONTAINER_USAGE)
    view = cluster_view(picture)
    assert view.nodes[0].gpus[0].memory_used_mib == 1024
    assert view.pods[0].containers[0].reporting
    clock.now += 8
    picture.on_inventory(INVENTORY)  # the node is alive, but usage and the hook went quiet
    clock.now += 3
    picture.sweep()
    assert picture.containers == {}
    view = cluster_view(picture)
    assert view.nodes[0].state == "up"
    assert view.nodes[0].gpus[0].memory_used_mib is None
    slice_view = view.nodes[0].gpus[0].slices[0]
    assert slice_view.memory_used_mib is None and slice_view.memory_limit_mib == 20480


def test_a_released_pod_is_not_revived_by_an_older_record(picture: ClusterPicture) -> None:
    picture.on_allocation(AllocationEvent(kind="released", allocation=ALLOCATION))
    assert picture.load_decisions([ALLOCATION]) == 0
    picture.on_allocation(AllocationEvent(kind="bound", allocation=ALLOCATION))
    assert picture.pods == {}


def test_pending_pods_expire_unless_re_sent(picture: ClusterPicture, clock: Clock) -> None:
    waiting = PendingPod(namespace="n", name="p", uid="u",
                         requests=[ContainerRequest(container="c", gpus=1)])  # fmt: skip
    picture.on_pending(waiting)
    clock.now += 50
    picture.on_pending(waiting)
    clock.now += 50
    picture.sweep()
    assert "u" in picture.pending
    assert cluster_view(picture).pending[0].waiting_s == 100.0  # from the first sighting
    clock.now += 61
    picture.sweep()
    assert picture.pending == {}


@pytest.mark.parametrize(
    ("apply", "reason"),
    [
        (lambda p: p.on_inventory(NodeInventory(node="", gpus=[])), "no_node"),
        (lambda p: p.on_inventory(NodeInventory(node="n", gpus=[
            GpuDevice(uuid="", index=0, model="T4", memory_mib=1)])), "bad_gpu"),
        (lambda p: p.on_inventory(NodeInventory(node="n", gpus=[
            GpuDevice(uuid="G", index=0, model="T4", memory_mib=-1)])), "bad_gpu"),
        (lambda p: p.on_usage(USAGE), "unknown_node"),
        (lambda p: p.on_pending(PendingPod(namespace="n", name="p", uid="")), "no_uid"),
    ],
)  # fmt: skip
def test_senseless_events_are_rejected_with_a_reason(
    picture: ClusterPicture, apply: object, reason: str
) -> None:
    with pytest.raises(EventRejected) as rejected:
        apply(picture)  # type: ignore[operator]
    assert rejected.value.reason == reason
    assert str(rejected.value)


def test_usage_naming_a_gpu_the_node_does_not_have_is_rejected(picture: ClusterPicture) -> None:
    picture.on_inventory(NodeInventory(node="node-a", gpus=INVENTORY.gpus[:1]))
    with pytest.raises(EventRejected, match="GPU-a1"):
        picture.on_usage(USAGE)


def test_pending_summary_names_the_most_common_reason() -> None:
    from services.common.schemas import PendingReason

    reasons = [PendingReason(message="too few GPUs", node_count=2),
               PendingReason(message="no room", nodes=["a", "b", "c"])]  # fmt: skip
    assert pending_summary(reasons, False) == "3 nodes: no room (+1 other reasons)"
    assert pending_summary([], True) == "can never fit in this cluster"
