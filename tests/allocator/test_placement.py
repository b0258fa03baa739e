"""First-fit placement, pure: no NATS, no HTTP."""

from __future__ import annotations

import pytest

from services.allocator.placement import (
    NoFit,
    Reserved,
    capacity_problem,
    describe_request,
    never_fits,
    place,
    place_on,
)
from services.common.schemas import ContainerRequest, GpuSlice

from .helpers import A100_MIB, gpu


def req(name: str = "c", gpus: int = 1, mem: int = 0, pct: int = 0, cores: int = 0):
    return ContainerRequest(
        container=name, gpus=gpus, memory_mib=mem, memory_percent=pct, cores=cores
    )


GPUS = [gpu("n", i) for i in range(4)]


def test_first_fit_takes_the_lowest_index_with_room() -> None:
    placed = place([req(mem=10000, cores=30)], GPUS, {"GPU-n-0": Reserved(35000, 0)})
    assert placed == {"c": [GpuSlice(uuid="GPU-n-1", index=1, memory_mib=10000, cores=30)]}


def test_gpu_order_follows_index_not_input_order() -> None:
    placed = place([req(mem=1000)], list(reversed(GPUS)), {})
    assert [s.uuid for s in placed["c"]] == ["GPU-n-0"]


def test_containers_reserve_cumulatively() -> None:
    placed = place([req("a", mem=30000), req("b", mem=30000), req("c", mem=5000)], GPUS, {})
    assert [s.uuid for s in placed["a"]] == ["GPU-n-0"]
    assert [s.uuid for s in placed["b"]] == ["GPU-n-1"]
    assert [s.uuid for s in placed["c"]] == ["GPU-n-0"]  # 10960 MiB left on GPU 0


def test_compute_share_is_reserved_too() -> None:
    placed = place([req("a", mem=100, cores=70), req("b", mem=100, cores=40)], GPUS, {})
    assert [s.uuid for s in placed["b"]] == ["GPU-n-1"]


def test_multi_gpu_container_gets_distinct_gpus() -> None:
    placed = place([req("a", gpus=3, mem=1000)], GPUS, {"GPU-n-1": Reserved(40000, 0)})
    assert [s.uuid for s in placed["a"]] == ["GPU-n-0", "GPU-n-2", "GPU-n-3"]


def test_memory_percent_and_whole_card() -> None:
    small = gpu("n", 9, memory_mib=16000)
    placed = place([req("p", pct=50), req("w", gpus=1, cores=100)], [small, *GPUS[:1]], {})
    assert placed["p"][0].memory_mib == A100_MIB // 2
    assert placed["p"][0].uuid == "GPU-n-0"  # index 0 comes first
    assert placed["w"] == [GpuSlice(uuid="GPU-n-9", index=9, memory_mib=16000, cores=100)]


def test_unhealthy_gpus_are_skipped() -> None:
    gpus = [gpu("n", 0, healthy=False), gpu("n", 1)]
    assert [s.uuid for s in place([req(mem=1)], gpus, {})["c"]] == ["GPU-n-1"]


def test_no_fit_names_container_request_and_room() -> None:
    gpus = [gpu("n", 0, healthy=False), gpu("n", 1)]
    with pytest.raises(NoFit) as caught:
        place([req("train", gpus=2, mem=20000, cores=30)], gpus, {})
    message = str(caught.value)
    assert "'train'" in message
    assert "nvidia.com/gpu: 2, nvidia.com/gpumem: 20000, nvidia.com/gpucores: 30" in message
    assert "2 GPUs each with 20000 MiB and 30% compute free" in message
    assert "1 of 2 GPUs have that room, 1 unhealthy" in message


def test_no_fit_counts_what_earlier_containers_took() -> None:
    with pytest.raises(NoFit, match="'b'"):
        place([req("a", gpus=2, cores=100), req("b", mem=1)], GPUS[:2], {})


def test_describe_request() -> None:
    assert describe_request(req(gpus=1, cores=100)) == "nvidia.com/gpu: 1"
    assert (
        describe_request(req(gpus=1, pct=25, cores=100))
        == "nvidia.com/gpu: 1, nvidia.com/gpumem-percentage: 25, nvidia.com/gpucores: 100"
    )


def test_capacity_ignores_reservations_and_health() -> None:
    gpus = [gpu("n", 0, healthy=False), gpu("n", 1)]
    assert capacity_problem([req(gpus=2, cores=100)], gpus) is None
    problem = capacity_problem([req(gpus=3)], gpus)
    assert problem is not None and "3 GPUs" in str(problem)


def test_never_fits_memory_larger_than_any_gpu() -> None:
    cluster = {"a": [gpu("a", 0)], "b": [gpu("b", 0, memory_mib=80000)]}
    reason = never_fits([req("big", mem=90000)], cluster)
    assert reason is not None
    assert "'big'" in reason and "nvidia.com/gpumem: 90000" in reason
    assert "largest GPU: 80000 MiB" in reason
    assert never_fits([req("ok", mem=70000)], cluster) is None


def test_never_fits_more_gpus_than_any_node() -> None:
    cluster = {"a": [gpu("a", i) for i in range(2)], "b": [gpu("b", i) for i in range(4)]}
    reason = never_fits([req("wide", gpus=8)], cluster)
    assert reason is not None and "most GPUs on one node: 4" in reason


def test_never_fits_together() -> None:
    cluster = {"a": [gpu("a", 0)]}
    reason = never_fits([req("x", cores=100), req("y", cores=100)], cluster)
    assert reason is not None and "'x', 'y'" in reason and "together" in reason


def test_never_fits_says_nothing_without_a_cluster() -> None:
    assert never_fits([req(mem=10**9)], {}) is None


def test_place_on_exact_gpus_in_given_order() -> None:
    slices = place_on(req(gpus=2, pct=10), [GPUS[3], GPUS[1]], {})
    assert [s.uuid for s in slices] == ["GPU-n-3", "GPU-n-1"]
    with pytest.raises(NoFit, match="GPU-n-1"):
        place_on(req(gpus=2, mem=5000), [GPUS[3], GPUS[1]], {"GPU-n-1": Reserved(40000, 0)})
    with pytest.raises(NoFit, match="needs 2 GPU"):
        place_on(req(gpus=2), [GPUS[0]], {})
