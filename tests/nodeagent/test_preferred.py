from __future__ import annotations

from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.gpus.simulated import SimulatedGpuBackend
from services.nodeagent.preferred import available_gpus, pick_on_gpus, spread_pick

GPUS = SimulatedGpuBackend("n", "3xT4").devices()
CATALOG = DeviceCatalog(GPUS, split_count=3)
A, B, C = (g.uuid for g in GPUS)


def ids(*pairs: tuple[str, int]) -> list[str]:
    return [f"{uuid}::{n}" for uuid, n in pairs]


def test_available_gpus_in_index_order_ignoring_unknown_ids() -> None:
    available = [*ids((C, 2), (A, 1)), "junk", "GPU-unknown::0"]
    assert available_gpus(available, CATALOG.gpu_of) == [A, C]


def test_hint_becomes_one_lowest_replica_per_gpu() -> None:
    available = ids((A, 2), (B, 1), (B, 0), (C, 0), (A, 1))
    assert pick_on_gpus(available, [], 2, [B, A], CATALOG.gpu_of) == ids((B, 0), (A, 1))


def test_hint_keeps_must_include_and_fails_when_it_cannot_fill() -> None:
    available = ids((A, 0), (B, 0), (C, 0))
    assert pick_on_gpus(available, ids((C, 0)), 2, [A, B], CATALOG.gpu_of) == ids((C, 0), (A, 0))
    assert pick_on_gpus(available, [], 2, [A], CATALOG.gpu_of) is None  # too few GPUs hinted
    assert pick_on_gpus(ids((A, 0)), [], 1, [B], CATALOG.gpu_of) is None  # GPU not available


def test_spread_takes_distinct_gpus_first_emptiest_first() -> None:
    available = ids((A, 0), (A, 1), (A, 2), (B, 2), (C, 1), (C, 0))
    assert spread_pick(available, [], 3, CATALOG.gpu_of) == ids((A, 0), (C, 0), (B, 2))
    assert spread_pick(available, [], 5, CATALOG.gpu_of) == ids(
        (A, 0), (C, 0), (B, 2), (A, 1), (C, 1)
    )
    # One container at a time (the usual size 1) goes to the GPU with the fewest sharers.
    assert spread_pick(ids((A, 2), (B, 0), (B, 1)), [], 1, CATALOG.gpu_of) == ids((B, 0))
    assert spread_pick(ids((A, 2), (B, 1)), [], 1, CATALOG.gpu_of) == ids((A, 2))  # tie: index


def test_spread_starts_with_must_include_and_avoids_its_gpu() -> None:
    available = ids((A, 0), (A, 1), (B, 0))
    assert spread_pick(available, ids((A, 1)), 2, CATALOG.gpu_of) == ids((A, 1), (B, 0))


def test_spread_never_fails_even_when_short() -> None:
    assert spread_pick(ids((A, 0)), [], 3, CATALOG.gpu_of) == ids((A, 0))
    assert spread_pick([], [], 1, CATALOG.gpu_of) == []
