"""Malformed extender calls get HTTP 400 naming what is wrong, never a 500."""

from __future__ import annotations

import msgspec
import pytest

from services.allocator import Allocator

from .helpers import container, pod, post

GOOD_POD = pod("p", [container("main")])

FILTER_CASES = [
    (b"", "not valid JSON"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "ExtenderArgs: expected a JSON object, got an array"),
    ({"NodeNames": ["n1"]}, "ExtenderArgs.Pod: missing"),
    ({"Pod": "p", "NodeNames": ["n1"]}, "ExtenderArgs.Pod: expected a v1.Pod object, got a string"),
    ({"Pod": {"spec": {}}, "NodeNames": ["n1"]}, "ExtenderArgs.Pod.metadata: expected an object"),
    (
        {"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": ["n1"]},
        "ExtenderArgs.Pod.metadata.uid",
    ),
    (
        {"Pod": {"metadata": {"name": "p", "uid": "u"}, "spec": []}, "NodeNames": ["n1"]},
        "ExtenderArgs.Pod.spec: expected an object, got an array",
    ),
    ({"Pod": GOOD_POD, "NodeNames": "n1"}, "ExtenderArgs.NodeNames: expected a list of strings"),
    ({"Pod": GOOD_POD, "NodeNames": ["n1", 7]}, "ExtenderArgs.NodeNames[1]"),
    ({"Pod": GOOD_POD, "Nodes": None, "NodeNames": None}, "give NodeNames"),
    ({"Pod": GOOD_POD, "Nodes": {"items": {}}}, "ExtenderArgs.Nodes.items: expected a list"),
    ({"Pod": GOOD_POD, "Nodes": {"items": [{"metadata": {}}]}}, "items[0].metadata.name"),
]


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
@pytest.mark.parametrize(("body", "complaint"), FILTER_CASES)
async def test_bad_extender_args(
    allocator: Allocator, http, verb: str, body: object, complaint: str
) -> None:
    status, answer = await post(http, f"{allocator.url}/scheduler/{verb}", body)
    assert status == 400
    assert complaint in answer["Error"], answer


BIND_CASES = [
    (b"nope", "not valid JSON"),
    (b'"x"', "ExtenderBindingArgs: expected a JSON object, got a string"),
    ({"PodName": "p", "PodNamespace": "ns", "PodUID": "u"}, "ExtenderBindingArgs.Node"),
    ({"PodName": "p", "PodNamespace": "ns", "PodUID": 5, "Node": "n"}, "PodUID"),
    ({"PodName": "", "PodNamespace": "ns", "PodUID": "u", "Node": "n"}, "PodName"),
]


@pytest.mark.parametrize(("body", "complaint"), BIND_CASES)
async def test_bad_binding_args(allocator: Allocator, http, body: object, complaint: str) -> None:
    status, answer = await post(http, f"{allocator.url}/scheduler/bind", body)
    assert status == 400
    assert complaint in answer["Error"], answer


async def test_odd_but_valid_container_shapes_are_unresolvable_not_errors(
    allocator: Allocator, http
) -> None:
    weird = pod("p", [container("main")])
    weird["spec"]["containers"] = "not-a-list"
    status, answer = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        {"Pod": weird, "Nodes": None, "NodeNames": ["n1"]},
    )
    assert status == 200
    assert "spec.containers" in answer["FailedAndUnresolvableNodes"]["n1"]


async def test_allocator_still_serves_after_bad_input(allocator: Allocator, http) -> None:
    for body, _ in FILTER_CASES:
        await post(http, f"{allocator.url}/scheduler/filter", body)
    status, answer = await post(
        http,
        f"{allocator.url}/scheduler/filter",
        msgspec.json.encode({"Pod": GOOD_POD, "Nodes": None, "NodeNames": []}),
    )
    assert status == 200 and answer["NodeNames"] == []


def _with_limits(limits: dict[str, object], requests: dict[str, object] | None = None) -> dict:
    resources: dict[str, object] = {"limits": limits}
    if requests is not None:
        resources["requests"] = requests
    return pod("q", [{"name": "main", "resources": resources}])


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
@pytest.mark.parametrize(
    ("limits", "field", "problem"),
    [
        ({"nvidia.com/gpumem": "\u0664k"}, "resources.limits[nvidia.com/gpumem]", "not ASCII"),
        ({"nvidia.com/gpu": "1x"}, "resources.limits[nvidia.com/gpu]", "unknown suffix 'x'"),
        ({"volcano.sh/vgpu-memory": "1e"}, "resources.limits[volcano.sh/vgpu-memory]",
         "unknown suffix"),
        ({"aliyun.com/gpu-mem": ".."}, "resources.limits[aliyun.com/gpu-mem]", "suffix"),
        ({"tencent.com/vcuda-core": "-30"}, "resources.limits[tencent.com/vcuda-core]",
         "must not be negative"),
        ({"cpu": "2 cores"}, "spec.containers[0].resources.limits.cpu", "unknown suffix"),
        ({"memory": "1GB"}, "spec.containers[0].resources.limits.memory", "unknown suffix 'GB'"),
    ],
)  # fmt: skip
async def test_malformed_quantities_are_a_400_naming_the_field(
    allocator: Allocator, http, verb: str, limits: dict[str, object], field: str, problem: str
) -> None:
    """The API server never stores a quantity that is not one: such a Pod is a bad body."""
    body = {"Pod": _with_limits(limits), "Nodes": None, "NodeNames": ["n1"]}
    status, answer = await post(http, f"{allocator.url}/scheduler/{verb}", body)
    assert status == 400, answer
    assert answer["Error"].startswith(f"bad {verb} request: Pod ")
    assert field in answer["Error"] and problem in answer["Error"]


@pytest.mark.parametrize("form", ["4k", "4000", "4e3", "4E3", "4000000m", "+4k", "3.9999k"])
async def test_every_quantity_form_is_read_as_the_api_server_stores_it(
    allocator: Allocator, http, form: str
) -> None:
    body = {"Pod": _with_limits({"nvidia.com/gpumem": form}, {"nvidia.com/gpumem": form}),
            "Nodes": None, "NodeNames": ["n1"]}  # fmt: skip
    request = allocator.core.parse(body["Pod"])  # type: ignore[arg-type]
    assert request.containers[0].memory_mib == 4000
    status, answer = await post(http, f"{allocator.url}/scheduler/filter", body)
    assert status == 200 and answer["Error"] == ""
