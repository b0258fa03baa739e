"""Stranded capacity: free memory that no waiting shape can use."""

from __future__ import annotations

from services.common.schemas import ContainerRequest
from services.metrics.stranded import FreeGpu, Shape, shapes_of, stranded_memory


def gpu(node: str, uuid: str, free: int, cores: int = 100, total: int = 40960) -> FreeGpu:
    return FreeGpu(node=node, uuid=uuid, memory_mib=total, free_memory_mib=free, free_cores=cores)


def test_nothing_is_stranded_while_nothing_waits() -> None:
    assert stranded_memory([gpu("n", "a", 100)], set()) == {}


def test_free_memory_too_small_for_every_shape_is_stranded() -> None:
    gpus = [gpu("n", "a", 10000), gpu("n", "b", 30000)]
    assert stranded_memory(gpus, {Shape(gpus=1, memory_mib=20000)}) == {"a": 10000}


def test_compute_share_counts_as_much_as_memory() -> None:
    gpus = [gpu("n", "a", 30000, cores=20), gpu("n", "b", 30000, cores=80)]
    assert stranded_memory(gpus, {Shape(gpus=1, memory_mib=1000, cores=50)}) == {"a": 30000}


def test_a_multi_gpu_shape_needs_enough_fitting_gpus_on_one_node() -> None:
    gpus = [gpu("n1", "a", 30000), gpu("n2", "b", 30000), gpu("n2", "c", 30000)]
    shape = {Shape(gpus=2, memory_mib=20000)}
    assert stranded_memory(gpus, shape) == {"a": 30000}


def test_whole_gpu_and_percentage_shapes() -> None:
    gpus = [gpu("n", "a", 40960), gpu("n", "b", 40000)]
    assert stranded_memory(gpus, {Shape(gpus=1, cores=100)}) == {"b": 40000}
    assert stranded_memory(gpus, {Shape(gpus=1, memory_percent=97)}) == {}
    assert stranded_memory(gpus, {Shape(gpus=1, memory_percent=100)}) == {"b": 40000}


def test_shapes_of_requests_skip_containers_without_gpus() -> None:
    requests = [ContainerRequest(container="a", gpus=0),
                ContainerRequest(container="b", gpus=2, memory_mib=100, cores=30),
                ContainerRequest(container="c", gpus=2, memory_mib=100, cores=30)]  # fmt: skip
    assert shapes_of(requests) == {Shape(gpus=2, memory_mib=100, cores=30)}
