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
