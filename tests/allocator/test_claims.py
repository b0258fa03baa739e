"""Claims and preferred-GPU hints over real NATS request/reply."""

from __future__ import annotations

import msgspec
import pytest

from services.allocator import Allocator, LocalClusterBackend
from services.allocator.cluster import Charge
from services.common import subjects
from services.common.bus import Bus, BusError
from services.common.schemas import (
    ClaimReply,
    ClaimRequest,
    PreferredReply,
    PreferredRequest,
)

from .conftest import MakeAllocator
from .helpers import (
    admit_to_cluster,
    bind_args,
    collect_events,
    container,
    eventually,
    filter_args,
    give_nodes,
    node_inventory,
    pod,
    post,
)


async def _bind(http, allocator: Allocator, p: dict, node: str) -> None:
    admit_to_cluster(allocator, p)
    _, result = await post(http, f"{allocator.url}/scheduler/filter", filter_args(p, [node]))
    assert result["NodeNames"] == [node], result
    _, answer = await post(http, f"{allocator.url}/scheduler/bind", bind_args(p, node))
    assert answer == {"Error": ""}


def _claim(p: dict, name: str, gpus: list[str], node: str = "n1") -> ClaimRequest:
    return ClaimRequest(
        node=node,
        namespace=p["metadata"]["namespace"],
        pod=p["metadata"]["name"],
        container=name,
        device_ids=[f"{g}::{i}" for i, g in enumerate(gpus)],
        gpu_uuids=gpus,
    )


async def test_claim_returns_the_decision_and_publishes(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    events = await collect_events(bus, "n1")
    p = pod("p", [container("a", mem=1000), container("b", gpus=2, mem=2000, cores=20)])
    await _bind(http, allocator, p, "n1")

    request = _claim(p, "b", ["GPU-n1-1", "GPU-n1-0"])  # the kubelet's order
    reply = await bus.request(subjects.ALLOC_CLAIM, request, ClaimReply)
    assert reply.error == ""
    assert reply.pod_uid == p["metadata"]["uid"]
    assert reply.traceparent == allocator.engine.allocations()[0].traceparent != ""
    assert reply.allocation is not None
    assert reply.allocation.container == "b"
    assert reply.allocation.claimed is True
    assert reply.allocation.device_ids == request.device_ids
    assert [(s.uuid, s.memory_mib, s.cores) for s in reply.allocation.slices] == [
        ("GPU-n1-1", 2000, 20),
        ("GPU-n1-0", 2000, 20),
    ]
    await eventually(lambda: len(events) == 2)
    assert [e.kind for e in events] == ["bound", "claimed"]
    assert events[1].allocation.containers["b"].claimed
    assert not events[1].allocation.containers["a"].claimed

    again = await bus.request(subjects.ALLOC_CLAIM, request, ClaimReply)
    assert again.allocation == reply.allocation
    await bus.client.flush()
    assert len(events) == 2  # an idempotent repeat announces nothing new


async def test_claim_of_unknown_pod_or_container_is_refused(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    p = pod("p", [container("a", mem=1000)])
    await _bind(http, allocator, p, "n1")
    with pytest.raises(BusError, match="no pod default/ghost is bound to node 'n1'"):
        await bus.request(
            subjects.ALLOC_CLAIM, _claim(pod("ghost", []), "a", ["GPU-n1-0"]), ClaimReply
        )
    with pytest.raises(BusError, match=r"no GPU allocation for container 'zzz'.*'a'"):
        await bus.request(subjects.ALLOC_CLAIM, _claim(p, "zzz", ["GPU-n1-0"]), ClaimReply)
    with pytest.raises(BusError, match="no pod default/p is bound to node 'n2'"):
        await bus.request(subjects.ALLOC_CLAIM, _claim(p, "a", ["GPU-n1-0"], "n2"), ClaimReply)


def _by_uid(uid: str, name: str, gpus: list[str], node: str = "n1") -> ClaimRequest:
    """As the node agent claims a plain init container found in the kubelet checkpoint."""
    unnamed = {"metadata": {"namespace": "", "name": ""}}
    return msgspec.structs.replace(_claim(unnamed, name, gpus, node), pod_uid=uid)


async def test_claim_by_pod_uid_names_the_pod_in_the_reply(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    events = await collect_events(bus, "n1")
    p = pod(
        "prep",
        [container("app", gpus=2, mem=4000, cores=30)],
        namespace="ml",
        init=[container("setup", mem=1000, cores=10)],
    )
    await _bind(http, allocator, p, "n1")
    uid = p["metadata"]["uid"]

    reply = await bus.request(subjects.ALLOC_CLAIM, _by_uid(uid, "setup", ["GPU-n1-1"]), ClaimReply)
    assert (reply.error, reply.pod_uid, reply.namespace, reply.pod) == ("", uid, "ml", "prep")
    assert reply.allocation is not None and reply.allocation.claimed
    assert reply.allocation.container == "setup"
    assert [(s.uuid, s.memory_mib, s.cores) for s in reply.allocation.slices] == [
        ("GPU-n1-1", 1000, 10)
    ]
    assert allocator.ledger.get(uid).containers["setup"].claimed
    assert not allocator.ledger.get(uid).containers["app"].claimed
    await eventually(lambda: len(events) == 2)
    assert [e.kind for e in events] == ["bound", "claimed"]

    # A claim by name says who it was too; an idempotent repeat by UID answers the same.
    by_name = await bus.request(
        subjects.ALLOC_CLAIM, _claim(p, "app", ["GPU-n1-0", "GPU-n1-1"]), ClaimReply
    )
    assert (by_name.namespace, by_name.pod, by_name.pod_uid) == ("ml", "prep", uid)
    again = await bus.request(subjects.ALLOC_CLAIM, _by_uid(uid, "setup", ["GPU-n1-1"]), ClaimReply)
    assert again.allocation == reply.allocation


async def test_claim_by_unknown_pod_uid_is_refused(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1"))
    await give_nodes(bus, allocator, node_inventory("n2"))
    p = pod("p", [container("a", mem=1000)], uid="uid-known")
    await _bind(http, allocator, p, "n1")
    with pytest.raises(BusError, match="no pod with uid uid-ghost is bound to node 'n1'"):
        await bus.request(subjects.ALLOC_CLAIM, _by_uid("uid-ghost", "a", ["GPU-n1-0"]), ClaimReply)
    with pytest.raises(BusError, match="no pod with uid uid-known is bound to node 'n2'"):
        await bus.request(
            subjects.ALLOC_CLAIM, _by_uid("uid-known", "a", ["GPU-n2-0"], "n2"), ClaimReply
        )
    with pytest.raises(BusError, match="names neither a pod nor a pod uid"):
        await bus.request(subjects.ALLOC_CLAIM, _by_uid("", "a", ["GPU-n1-0"]), ClaimReply)
    with pytest.raises(BusError, match=r"pod default/p on node 'n1' has no GPU allocation .*'zzz'"):
        await bus.request(
            subjects.ALLOC_CLAIM, _by_uid("uid-known", "zzz", ["GPU-n1-0"]), ClaimReply
        )
    assert not allocator.ledger.get("uid-known").containers["a"].claimed


def test_claim_request_without_pod_uid_still_decodes() -> None:
    """Wire compatibility: an agent that predates claims by UID."""
    old = b'{"node":"n1","namespace":"d","pod":"p","container":"a","device_ids":[],"gpu_uuids":[]}'
    assert msgspec.json.decode(old, type=ClaimRequest).pod_uid == ""
    reply = msgspec.json.decode(b'{"pod_uid":"u"}', type=ClaimReply)
    assert (reply.namespace, reply.pod) == ("", "")


async def test_claim_on_other_gpus_moves_when_they_fit(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=3))
    p = pod("p", [container("a", percent=50)])
    await _bind(http, allocator, p, "n1")
    assert [s.uuid for s in allocator.engine.allocations()[0].containers["a"].slices] == [
        "GPU-n1-0"
    ]
    reply = await bus.request(subjects.ALLOC_CLAIM, _claim(p, "a", ["GPU-n1-2"]), ClaimReply)
    assert reply.allocation is not None
    assert [(s.uuid, s.index, s.memory_mib) for s in reply.allocation.slices] == [
        ("GPU-n1-2", 2, 20480)
    ]
    assert set(allocator.ledger.reserved("n1")) == {"GPU-n1-2"}


def _gpus_of(allocator: Allocator, p: dict, name: str) -> list[str]:
    allocation = allocator.ledger.get(p["metadata"]["uid"])
    assert allocation is not None
    return [s.uuid for s in allocation.containers[name].slices]


def _within_capacity(allocator: Allocator, node: str = "n1") -> bool:
    state = allocator.cluster.node(node)
    assert state is not None
    return all(g.used.memory_mib <= g.memory_mib and g.used.slots <= g.slots for g in state.gpus)


async def test_swapped_admission_on_a_full_node_both_claims_succeed(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    events = await collect_events(bus, "n1")
    first = pod("first", [container("a", mem=30000)])
    second = pod("second", [container("a", mem=30000)])
    await _bind(http, allocator, first, "n1")
    await _bind(http, allocator, second, "n1")
    assert _gpus_of(allocator, first, "a") == ["GPU-n1-0"]
    assert _gpus_of(allocator, second, "a") == ["GPU-n1-1"]

    # The kubelet admits `second` first and hands it GPU 0, reserved for unclaimed `first`.
    reply = await bus.request(subjects.ALLOC_CLAIM, _claim(second, "a", ["GPU-n1-0"]), ClaimReply)
    assert reply.allocation is not None
    assert [(s.uuid, s.memory_mib) for s in reply.allocation.slices] == [("GPU-n1-0", 30000)]
    assert _gpus_of(allocator, first, "a") == ["GPU-n1-1"]  # displaced, still unclaimed
    assert not allocator.ledger.get(first["metadata"]["uid"]).containers["a"].claimed
    assert _within_capacity(allocator)
    await eventually(lambda: len(events) == 4)
    assert [(e.kind, e.allocation.name) for e in events[2:]] == [
        ("claimed", "second"),
        ("bound", "first"),
    ]
    assert [s.uuid for s in events[3].allocation.containers["a"].slices] == ["GPU-n1-1"]

    again = await bus.request(subjects.ALLOC_CLAIM, _claim(second, "a", ["GPU-n1-0"]), ClaimReply)
    assert again.allocation == reply.allocation  # idempotent

    # Then `first` arrives and the kubelet gives it the other GPU: it follows, nothing moves.
    reply = await bus.request(subjects.ALLOC_CLAIM, _claim(first, "a", ["GPU-n1-1"]), ClaimReply)
    assert reply.allocation is not None and reply.allocation.claimed
    assert _gpus_of(allocator, first, "a") == ["GPU-n1-1"]
    assert _gpus_of(allocator, second, "a") == ["GPU-n1-0"]
    assert allocator.ledger.reserved("n1") == {
        "GPU-n1-0": Charge(30000, 0, 1),
        "GPU-n1-1": Charge(30000, 0, 1),
    }


async def test_claim_displaces_an_unclaimed_container_of_its_own_pod(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    p = pod("p", [container("a", mem=30000), container("b", mem=30000)])
    await _bind(http, allocator, p, "n1")
    assert (_gpus_of(allocator, p, "a"), _gpus_of(allocator, p, "b")) == (
        ["GPU-n1-0"],
        ["GPU-n1-1"],
    )
    await bus.request(subjects.ALLOC_CLAIM, _claim(p, "b", ["GPU-n1-0"]), ClaimReply)
    assert (_gpus_of(allocator, p, "a"), _gpus_of(allocator, p, "b")) == (
        ["GPU-n1-1"],
        ["GPU-n1-0"],
    )
    assert _within_capacity(allocator)


async def test_claim_refused_when_the_displaced_container_fits_nowhere(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    big = pod("big", [container("a", mem=30000)])
    small = pod("small", [container("a", mem=20000)])
    other = pod("other", [container("a", mem=20000)])
    for p in (big, small, other):
        await _bind(http, allocator, p, "n1")  # big: GPU 0; small and other: GPU 1
    assert _gpus_of(allocator, other, "a") == ["GPU-n1-1"]
    before = allocator.ledger.reserved("n1")
    # small onto GPU 0 would push big out, and GPU 1 (other's 20000 MiB) cannot take it.
    with pytest.raises(BusError, match=r"GPU-n1-0 .*unclaimed containers a of pod default/big"):
        await bus.request(subjects.ALLOC_CLAIM, _claim(small, "a", ["GPU-n1-0"]), ClaimReply)
    assert allocator.ledger.reserved("n1") == before  # nothing moved
    assert _gpus_of(allocator, big, "a") == ["GPU-n1-0"]
    assert _gpus_of(allocator, small, "a") == ["GPU-n1-1"]
    assert not allocator.ledger.get(small["metadata"]["uid"]).containers["a"].claimed


async def test_claim_never_displaces_a_claimed_container(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    big = pod("big", [container("a", mem=30000)])
    small = pod("small", [container("a", mem=30000)])
    await _bind(http, allocator, big, "n1")  # GPU 0
    await _bind(http, allocator, small, "n1")  # GPU 1
    await bus.request(subjects.ALLOC_CLAIM, _claim(big, "a", ["GPU-n1-0"]), ClaimReply)
    with pytest.raises(
        BusError, match=r"given GPUs GPU-n1-0 .*chose GPU-n1-1.*GPU-n1-0 lack the room \(held by"
    ):
        await bus.request(subjects.ALLOC_CLAIM, _claim(small, "a", ["GPU-n1-0"]), ClaimReply)
    with pytest.raises(BusError, match="GPU-nowhere"):
        await bus.request(subjects.ALLOC_CLAIM, _claim(small, "a", ["GPU-nowhere"]), ClaimReply)
    assert _gpus_of(allocator, big, "a") == ["GPU-n1-0"]
    decided = allocator.ledger.get(small["metadata"]["uid"]).containers["a"]
    assert [s.uuid for s in decided.slices] == ["GPU-n1-1"] and not decided.claimed


async def test_preferred_hints_in_bind_order_once_each(
    allocator: Allocator, bus: Bus, http
) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=4))
    first = pod("first", [container("a", gpus=1, cores=100)])  # GPU 0
    second = pod("second", [container("a", gpus=1, cores=100)])  # GPU 1
    pair = pod("pair", [container("a", gpus=2, cores=100)])  # GPUs 2, 3
    for p in (first, second, pair):
        await _bind(http, allocator, p, "n1")
    every = [f"GPU-n1-{i}" for i in range(4)]

    async def hint(available: list[str], size: int = 1) -> list[str]:
        reply = await bus.request(
            subjects.ALLOC_PREFERRED,
            PreferredRequest(node="n1", available_gpus=available, size=size),
            PreferredReply,
        )
        return reply.gpu_uuids

    assert await hint(every, size=2) == ["GPU-n1-2", "GPU-n1-3"]
    assert await hint(["GPU-n1-1", "GPU-n1-3"]) == ["GPU-n1-1"]  # GPU 0 is not available
    assert await hint(every) == ["GPU-n1-0"]
    assert await hint(every) == []  # everyone was hinted
    other = await bus.request(
        subjects.ALLOC_PREFERRED,
        PreferredRequest(node="n9", available_gpus=every, size=1),
        PreferredReply,
    )
    assert other.gpu_uuids == []
    with pytest.raises(BusError, match="at least 1"):
        await hint(every, size=0)


async def test_claimed_containers_are_not_hinted(allocator: Allocator, bus: Bus, http) -> None:
    await give_nodes(bus, allocator, node_inventory("n1", count=2))
    first = pod("first", [container("a", cores=100)])
    second = pod("second", [container("a", cores=100)])
    await _bind(http, allocator, first, "n1")
    await _bind(http, allocator, second, "n1")
    await bus.request(subjects.ALLOC_CLAIM, _claim(first, "a", ["GPU-n1-0"]), ClaimReply)
    reply = await bus.request(
        subjects.ALLOC_PREFERRED,
        PreferredRequest(node="n1", available_gpus=["GPU-n1-0", "GPU-n1-1"], size=1),
        PreferredReply,
    )
    assert reply.gpu_uuids == ["GPU-n1-1"]


async def test_replica_rebuilt_from_the_store_re_plans_with_the_pods_from_the_cluster(
    make_allocator: MakeAllocator, bus: Bus, http
) -> None:
    backend = LocalClusterBackend()
    first = await make_allocator(backend=backend)
    await give_nodes(bus, first, node_inventory("n1", count=2))
    one = pod("one", [container("a", mem=30000)])
    two = pod("two", [container("a", mem=30000)])
    await _bind(http, first, one, "n1")  # GPU 0
    await _bind(http, first, two, "n1")  # GPU 1
    await first.stop()

    second = await make_allocator(backend=backend)  # knows the records, not the requests
    await give_nodes(bus, second, node_inventory("n1", count=2))
    assert second.ledger.pod_request_of(one["metadata"]["uid"]) is None
    reply = await bus.request(subjects.ALLOC_CLAIM, _claim(two, "a", ["GPU-n1-0"]), ClaimReply)
    assert reply.allocation is not None
    assert _gpus_of(second, two, "a") == ["GPU-n1-0"]
    assert _gpus_of(second, one, "a") == ["GPU-n1-1"]
    assert _within_capacity(second)
