"""Requests in vgpu's (HAMi's) names and in the peers' syntaxes, and the selection annotations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.allocator.pod_request import parse_pod
from services.allocator.policies import POLICIES
from services.allocator.settings import AllocatorSettings
from services.common.config import ConfigError, load_settings
from services.common.resources import (
    RequestConfig,
    RequestError,
    ResourceNames,
    container_requests,
)

KNOWN = frozenset(POLICIES)


def pod(limits: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "annotations": annotations or {}},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


def one(limits: dict[str, Any], **kwargs: Any) -> tuple[int, int, int, int]:
    (request,) = container_requests(
        pod(limits, kwargs.get("annotations")), kwargs.get("config", RequestConfig())
    )
    return request.gpus, request.memory_mib, request.memory_percent, request.cores


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"nvidia.com/gpumem": 3000}, (1, 3000, 0, 0)),  # HAMi: gpu defaults to 1, cores 0
        ({"nvidia.com/gpucores": 30}, (1, 0, 0, 30)),  # memory defaults to the whole card
        ({"nvidia.com/gpu": 2}, (2, 0, 0, 100)),  # bare count: whole GPUs
        (
            {
                "volcano.sh/vgpu-number": 1,
                "volcano.sh/vgpu-memory": 2048,
                "volcano.sh/vgpu-cores": 25,
            },
            (1, 2048, 0, 25),
        ),
        ({"volcano.sh/vgpu-memory-percentage": 40}, (1, 0, 40, 0)),
        ({"aliyun.com/gpu-mem": 4}, (1, 4096, 0, 0)),  # GiB, no compute share
        (
            {"tencent.com/vcuda-core": 50, "tencent.com/vcuda-memory": 20},
            (1, 5120, 0, 50),
        ),  # 256 MiB units
        ({"tencent.com/vcuda-core": 200}, (2, 0, 0, 100)),  # whole GPUs
        # gpu-manager's docker.com spelling reads exactly as tencent.com
        ({"docker.com/vcuda-core": 50, "docker.com/vcuda-memory": 20}, (1, 5120, 0, 50)),
        ({"docker.com/vcuda-core": 100}, (1, 0, 0, 100)),
        ({"docker.com/vcuda-core": 30, "tencent.com/vcuda-core": 30}, (1, 0, 0, 30)),
    ],
)
def test_own_and_peer_syntaxes(limits: dict[str, Any], expected: tuple[int, int, int, int]) -> None:
    assert one(limits) == expected


def test_kai_annotations_apply_to_the_first_app_container() -> None:
    assert one({}, annotations={"gpu-fraction": "0.25"}) == (1, 0, 25, 0)
    assert one({}, annotations={"gpu-memory": "2000"}) == (1, 2000, 0, 0)


def test_aws_vgpus_are_read_as_a_count_sized_per_gpu() -> None:
    # N of the GPU's K vGPUs: K is each GPU's split count, known only at placement
    # (tests/allocator/test_node_sharing.py), so the request keeps N.
    for limits in (
        {"k8s.amazonaws.com/vgpu": 3},
        {"k8s.amazonaws.com/vgpu": 3, "nvidia.com/gpu": 1},
    ):
        (request,) = container_requests(pod(limits))
        assert (request.gpus, request.vgpus, request.memory_mib, request.cores) == (1, 3, 0, 0)
    with pytest.raises(RequestError, match="must be at least 1"):
        one({"k8s.amazonaws.com/vgpu": 0})
    with pytest.raises(RequestError, match=r"mixes nvidia\.com/gpu with k8s\.amazonaws\.com/vgpu"):
        one({"k8s.amazonaws.com/vgpu": 3, "nvidia.com/gpu": 2})


def test_hami_defaults_and_names_are_configurable() -> None:
    config = RequestConfig(
        names=ResourceNames(gpu="example.com/vgpu", memory="example.com/vmem"),
        default_memory_mib=1024,
        default_cores=10,
    )
    assert one({"example.com/vgpu": 1, "example.com/vmem": 500}, config=config) == (1, 500, 0, 10)
    assert one({"nvidia.com/gpucores": 20, "example.com/vgpu": 1}, config=config) == (
        1,
        1024,
        0,
        20,
    )


@pytest.mark.parametrize(
    ("limits", "annotations", "message"),
    [
        ({"nvidia.com/gpumem": 1, "volcano.sh/vgpu-memory": 1}, {}, "use one request syntax"),
        (
            {"aliyun.com/gpu-mem": 1, "tencent.com/vcuda-core": 10},
            {},
            "mixes the aliyun and tencent",
        ),
        ({"tencent.com/vcuda-core": 150}, {}, "multiple of 100"),
        ({"tencent.com/vcuda-memory": 4}, {}, "needs tencent.com/vcuda-core"),
        ({"docker.com/vcuda-memory": 4}, {}, "docker.com/vcuda-memory needs docker.com/vcuda-core"),
        ({"docker.com/vcuda-core": 250}, {}, "docker.com/vcuda-core: above 100 it must be"),
        ({"docker.com/vcuda-core": 20, "tencent.com/vcuda-core": 30}, {}, "disagree"),
        (
            {"docker.com/vcuda-core": 20, "aliyun.com/gpu-mem": 1},
            {},
            "mixes the aliyun and tencent",
        ),
        ({"k8s.amazonaws.com/vgpu": 0}, {}, "must be at least 1 (vGPUs of one GPU)"),
        ({}, {"gpu-fraction": "1.5"}, "expected a number in (0, 1]"),
        ({"nvidia.com/priority": 7, "nvidia.com/gpumem": 1}, {}, "0 (high) or 1 (low)"),
    ],
)
def test_bad_requests_say_what_is_wrong(
    limits: dict[str, Any], annotations: dict[str, str], message: str
) -> None:
    with pytest.raises(RequestError) as caught:
        container_requests(pod(limits, annotations))
    assert message in str(caught.value)


def test_selection_policies_numa_and_host_needs() -> None:
    spec = pod(
        {"nvidia.com/gpu": 2},
        {
            "nvidia.com/use-gputype": "A100, H100",
            "nvidia.com/nouse-gpuuuid": "GPU-x",
            "hami.io/node-scheduler-policy": "spread",
            "hami.io/gpu-scheduler-policy": "topology-aware",
            "nvidia.com/numa-bind": "true",
        },
    )
    spec["spec"]["containers"][0]["resources"]["requests"] = {
        "cpu": "1500m",
        "memory": "2Gi",
        "nvidia.com/gpu": 2,
    }
    request = parse_pod(spec, KNOWN)
    assert request.selection.use_types == ("a100", "h100")
    assert request.selection.nouse_uuids == frozenset({"GPU-x"})
    assert (request.node_policy, request.gpu_policy, request.numa_bind) == (
        "spread",
        "topology",
        True,
    )
    assert (request.cpu_milli, request.memory_mib) == (1500, 2048)
    with pytest.raises(RequestError, match="unknown policy 'best'"):
        parse_pod(pod({"nvidia.com/gpu": 1}, {"hami.io/gpu-scheduler-policy": "best"}), KNOWN)


def test_the_allocator_has_no_aws_count_of_its_own(tmp_path: Path) -> None:
    # The node agent's --vgpu (split count) is the one place; a second one could disagree.
    config = tmp_path / "vgpu.yaml"
    config.write_text("allocator:\n  vgpu: 4\n")
    with pytest.raises(ConfigError, match=r"unknown allocator setting\(s\): .*vgpu"):
        load_settings(AllocatorSettings, section="allocator", file=config, environ={})


def test_gpushares_memory_unit_setting() -> None:
    # gpushare's --memory-unit=MiB: aliyun.com/gpu-mem counts MiB.
    settings = load_settings(AllocatorSettings, section="allocator", environ={},
                             overrides={"memory_unit": "MiB"})  # fmt: skip
    assert one({"aliyun.com/gpu-mem": 3000}, config=settings.request_config()) == (1, 3000, 0, 0)
    assert one({"aliyun.com/gpu-mem": 3}) == (1, 3072, 0, 0)  # GiB by default
    with pytest.raises(ConfigError, match="memory_unit"):
        load_settings(AllocatorSettings, section="allocator", environ={},
                      overrides={"memory_unit": "GB"})  # fmt: skip
