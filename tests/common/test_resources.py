"""Translation of a pod's GPU resources into per-container requests."""

from __future__ import annotations

from typing import Any

import pytest

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
