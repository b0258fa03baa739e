"""Translation of a pod's GPU resources into per-container requests."""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.common.quantity import QuantityError
from services.common.resources import RequestError, container_requests


def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"spec": {"containers": list(containers), "initContainers": list(init)}}


def container(name: str, **limits: Any) -> dict[str, Any]:
    return {"name": name, "resources": {"limits": limits}}


def test_half_gpu_by_memory_and_cores() -> None:
    (request,) = container_requests(
        pod(container("main", **{"nvidia.com/gpumem": "20480", "nvidia.com/gpucores": 50}))
    )
    assert (request.container, request.gpus, request.memory_mib, request.cores) == (
        "main", 1, 20480, 50,
    )  # fmt: skip


def test_bare_gpu_count_means_whole_gpus() -> None:
    (request,) = container_requests(pod(container("train", **{"nvidia.com/gpu": 2})))
    assert (request.gpus, request.memory_mib, request.memory_percent, request.cores) == (
        2,
        0,
        0,
        100,
    )


def test_containers_without_gpu_are_skipped_and_init_containers_come_first() -> None:
    requests = container_requests(
        pod(
            container("sidecar"),
            container("app", **{"nvidia.com/gpumem": 1000}),
            init=(container("warmup", **{"nvidia.com/gpumem": 500}),),
        )
    )
    assert [(r.container, r.init) for r in requests] == [("warmup", True), ("app", False)]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"nvidia.com/gpucores": 150}, "gpucores: must be 0-100, got 150"),
        ({"nvidia.com/gpumem": 100, "nvidia.com/gpumem-percentage": 10}, "not both"),
        ({"nvidia.com/gpu": 0, "nvidia.com/gpumem": 100}, "must be at least 1"),
    ],
)
def test_bad_requests_name_the_container_and_resource(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match="'main'") as failure:
        container_requests(pod(container("main", **limits)))
    assert message in str(failure.value)


def test_requests_must_equal_limits() -> None:
    spec = {"name": "main", "resources": {"limits": {"nvidia.com/gpumem": 10},
                                          "requests": {"nvidia.com/gpumem": 20}}}  # fmt: skip
    with pytest.raises(RequestError, match="requests must equal limits"):
        container_requests(pod(spec))


@pytest.mark.parametrize(
    "bad", [{}, {"spec": []}, {"spec": {"containers": "x"}}, {"spec": {"containers": [{}]}}]
)
def test_malformed_pods_raise_request_error(bad: dict[str, Any]) -> None:
    with pytest.raises(RequestError):
        container_requests(bad)


@pytest.mark.parametrize(
    ("limits", "annotations", "expected"),
    [
        ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4k"}, {}, (1, 4000, 0, 0)),
        ({"nvidia.com/gpumem": "1Ki", "nvidia.com/gpucores": "3e1"}, {}, (1, 1024, 0, 30)),
        ({"nvidia.com/gpumem-percentage": "500m"}, {}, (1, 0, 1, 0)),  # Value() rounds up
        ({"volcano.sh/vgpu-number": "2E0", "volcano.sh/vgpu-memory": "2.5k"}, {}, (2, 2500, 0, 0)),
        ({"aliyun.com/gpu-mem": "+2"}, {}, (1, 2048, 0, 0)),
        ({"tencent.com/vcuda-core": "0.05k", "tencent.com/vcuda-memory": "1e1"}, {},
         (1, 2560, 0, 50)),
        ({"tencent.com/vcuda-core": "2e2"}, {}, (2, 0, 0, 100)),
        ({"k8s.amazonaws.com/vgpu": "5000m"}, {}, (1, 0, 0, 0)),  # 5 vGPUs, sized per GPU
        ({}, {"gpu-memory": "2k"}, (1, 2000, 0, 0)),
        ({}, {"gpu-fraction": "250m"}, (1, 0, 25, 0)),
    ],
)  # fmt: skip
def test_every_syntax_reads_kubernetes_quantities(
    limits: dict[str, Any], annotations: dict[str, str], expected: tuple[int, int, int, int]
) -> None:
    spec = pod(container("main", **limits))
    spec["metadata"] = {"annotations": annotations}
    (request,) = container_requests(spec)
    assert (request.gpus, request.memory_mib, request.memory_percent, request.cores) == expected


@pytest.mark.parametrize(
    ("limits", "annotations", "field"),
    [
        ({"volcano.sh/vgpu-memory": "1\u0660"}, {}, "resources.limits[volcano.sh/vgpu-memory]"),
        ({"aliyun.com/gpu-mem": "2G i"}, {}, "resources.limits[aliyun.com/gpu-mem]"),
        ({"k8s.amazonaws.com/vgpu": "1e"}, {}, "resources.limits[k8s.amazonaws.com/vgpu]"),
        ({}, {"gpu-memory": "2 k"}, "annotation gpu-memory"),
    ],
)  # fmt: skip
def test_malformed_quantities_in_any_syntax_name_the_field(
    limits: dict[str, Any], annotations: dict[str, str], field: str
) -> None:
    spec = pod(container("main", **limits))
    spec["metadata"] = {"annotations": annotations}
    with pytest.raises(QuantityError, match=re.escape(field)):
        container_requests(spec)


def test_requests_equal_limits_in_any_form() -> None:
    spec = {"name": "main", "resources": {"limits": {"nvidia.com/gpumem": "4k"},
                                          "requests": {"nvidia.com/gpumem": "4000"}}}  # fmt: skip
    (request,) = container_requests(pod(spec))
    assert request.memory_mib == 4000
    spec["resources"]["requests"]["nvidia.com/gpumem"] = "3999.5"  # rounds to 4000, not equal
    with pytest.raises(RequestError, match="requests must equal limits"):
        container_requests(pod(spec))
