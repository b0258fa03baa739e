"""Dynamic MIG placement through the placement core: the smallest fitting profile at a start
that respects the GPU's geometry (ledger and live instances), refusals naming the request."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from services.allocator.cluster import CapacityConfig, ClusterState
from services.allocator.core import PlacementCore, PodRef, Unplaceable
from services.allocator.ledger import Ledger
from services.allocator.mig_fit import live_mask, mask_of
from services.common.schemas import GpuDevice, MigDevice, NodeInventory, PodAllocation

from .helpers import container, pod


def dynamic_gpu(index: int, model: str = "A100-40GB", **fields: Any) -> GpuDevice:
    memory = {"A100-40GB": 40960, "H100-80GB": 81559}[model]
    return GpuDevice(
        uuid=f"GPU-n-{index}",
        index=index,
        model=model,
        memory_mib=memory,
        mig_mode=True,
        mig_dynamic=True,
        **fields,
    )


def make_core(*gpus: GpuDevice, reserve: int = 1024) -> PlacementCore:
    cluster = ClusterState(15, CapacityConfig(memory_reserve_mib=reserve))
    cluster.update(NodeInventory(node="n", gpus=list(gpus)))
    return PlacementCore(cluster, Ledger(cluster), node_policy="binpack", gpu_policy="binpack")


def commit(core: PlacementCore, p: dict[str, Any]) -> PodAllocation:
    ref = PodRef("default", p["metadata"]["name"], p["metadata"]["uid"])
    return core.commit(ref, "n", core.parse(p))


def mig_of(allocation: PodAllocation) -> list[tuple[str, int]]:
    return [
        (piece.mig_profile, piece.mig_start)
        for c in allocation.containers.values()
        for piece in c.slices
    ]


def test_smallest_fitting_profile_and_geometry_respected() -> None:
    core = make_core(dynamic_gpu(0))
    small = commit(core, pod("small", [container("m", mem=4000)]))
    assert mig_of(small) == [("1g.5gb", 6)]  # top slot: both halves stay open
    piece = small.containers["m"].slices[0]
    assert (piece.memory_mib, piece.cores) == (4864, 14)
    mid = commit(core, pod("mid", [container("m", mem=12000)]))
    assert mig_of(mid) == [("3g.20gb", 0)]  # slices 4-7 are broken by the 1g at 6
    # 9000 MiB: 1g.10gb (one compute slice) before 2g.10gb, at slices 4-5 (6-7 meets the 1g).
    assert mig_of(commit(core, pod("two", [container("m", mem=9000)]))) == [("1g.10gb", 4)]
    # Only slice 7 is free now, where no 1g.5gb may start.
    with pytest.raises(Unplaceable, match=r"nvidia\.com/gpumem: 4000"):
        commit(core, pod("full", [container("m", mem=4000)]))


def test_whole_gpu_request_gets_the_7g_profile_and_too_large_never_fits() -> None:
    core = make_core(dynamic_gpu(0, "H100-80GB"))
    whole = commit(core, pod("whole", [container("m")]))
    assert mig_of(whole) == [("7g.80gb", 0)]
    assert core.never_fits(core.parse(pod("huge", [container("m", mem=90000)])))
    assert core.never_fits(core.parse(pod("ok", [container("m", mem=15000)]))) is None


def test_live_instances_block_their_slices() -> None:
    # An operator's 4g.20gb at 0 and 3g.20gb at 4: nothing fits until they are destroyed.
    instances = [
        MigDevice(uuid="MIG-a", profile="4g.20gb", gi_profile="4g.20gb", gi_id=0, ci_id=0,
                  start=0, size=4, memory_mib=19968),
        MigDevice(uuid="MIG-b", profile="3g.20gb", gi_profile="3g.20gb", gi_id=1, ci_id=0,
                  start=4, size=4, memory_mib=19968),
    ]  # fmt: skip
    assert live_mask(instances) == 0xFF
    core = make_core(dynamic_gpu(0, mig_devices=instances))
    with pytest.raises(Unplaceable):
        commit(core, pod("blocked", [container("m", mem=1000)]))
    core.cluster.update(NodeInventory(node="n", gpus=[dynamic_gpu(0, mig_devices=instances[:1])]))
    assert mig_of(commit(core, pod("after", [container("m", mem=1000)]))) == [("1g.5gb", 6)]


def test_release_frees_the_slices_and_masks_stay_disjoint() -> None:
    core = make_core(dynamic_gpu(0), dynamic_gpu(1))
    placed = [commit(core, pod(f"p{i}", [container("m", mem=4000)])) for i in range(14)]
    masks: dict[str, int] = {}
    for allocation in placed:
        (piece,) = allocation.containers["m"].slices
        mask = mask_of(piece.mig_start, 1)
        assert not masks.get(piece.uuid, 0) & mask, "two instances share a memory slice"
        masks[piece.uuid] = masks.get(piece.uuid, 0) | mask
    assert masks == {"GPU-n-0": 0x7F, "GPU-n-1": 0x7F}  # 7 x 1g.5gb each: slice 7 unused
    with pytest.raises(Unplaceable):
        commit(core, pod("fifteenth", [container("m", mem=4000)]))
    core.ledger.release(placed[3].uid)
    again = commit(core, pod("again", [container("m", mem=4000)]))
    assert mig_of(again) == mig_of(placed[3])


def test_plain_gpus_beside_dynamic_ones_keep_vgpu_slices() -> None:
    plain = GpuDevice(uuid="GPU-n-1", index=1, model="A100-40GB", memory_mib=40960)
    core = make_core(dynamic_gpu(0), plain)
    first = commit(core, pod("a", [container("m", mem=30000)]))  # binpack: either; check shape
    (piece,) = first.containers["m"].slices
    if piece.uuid == "GPU-n-0":
        assert (piece.mig_profile, piece.memory_mib) == ("7g.40gb", 40192)
    else:
        assert (piece.mig_profile, piece.memory_mib) == ("", 30000)
    # Init containers do not take MIG instances: they go to the plain GPU.
    with_init = commit(
        core, pod("b", [{"name": "m", "image": "cuda"}], init=[container("i", mem=1000)])
    )
    assert with_init.containers["i"].slices[0].uuid == "GPU-n-1"
    # A slice survives the wire with its MIG fields (journal, events, claims).
    decoded = msgspec.json.decode(msgspec.json.encode(first), type=PodAllocation)
    assert decoded.containers["m"].slices == first.containers["m"].slices
