"""The scheduler extender's JSON shapes (kube-scheduler's Go field names, to the letter).

Decoding checks every shape the handlers rely on and raises BadRequest naming the field, so
a malformed call gets HTTP 400 with a reason instead of an exception deep in the engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import msgspec

from services.common.utf8 import utf8_problem

from .core import FilterOutcome


class BadRequest(ValueError):
    """The request body is not what kube-scheduler sends; the message names the field."""


@dataclass(frozen=True)
class ExtenderArgs:
    pod: dict[str, Any]
    node_names: list[str]
    node_list: dict[str, Any] | None  # the NodeList when sent in the Nodes form, else None


@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def _not_utf8(body: bytes, what: str) -> BadRequest:
    return BadRequest(utf8_problem(body, what) or f"{what}: not valid UTF-8")


def decode_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        decoded = msgspec.json.decode(body)
    except UnicodeDecodeError as exc:  # a string that is not UTF-8: name its field
        raise _not_utf8(body, what) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(
            utf8_problem(body, what) or f"request body is not valid JSON: {exc}"
        ) from exc
    if not isinstance(decoded, dict):
        raise BadRequest(f"{what}: expected a JSON object, got {_kind(decoded)}")
    return decoded


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _nonempty_string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}: expected a non-empty string, got {_kind(value)}")
    return value


def _check_pod(pod: Any) -> dict[str, Any]:
    if not isinstance(pod, dict):
        raise BadRequest(f"ExtenderArgs.Pod: expected a v1.Pod object, got {_kind(pod)}")
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        raise BadRequest(f"ExtenderArgs.Pod.metadata: expected an object, got {_kind(metadata)}")
    _nonempty_string(metadata.get("name"), "ExtenderArgs.Pod.metadata.name")
    _nonempty_string(metadata.get("uid"), "ExtenderArgs.Pod.metadata.uid")
    namespace = metadata.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise BadRequest(
            f"ExtenderArgs.Pod.metadata.namespace: expected a string, got {_kind(namespace)}"
        )
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise BadRequest(f"ExtenderArgs.Pod.spec: expected an object, got {_kind(spec)}")
    return pod


def _node_names(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise BadRequest(f"ExtenderArgs.NodeNames: expected a list of strings, got {_kind(value)}")
    for i, name in enumerate(value):
        _nonempty_string(name, f"ExtenderArgs.NodeNames[{i}]")
    return value


def _node_list(value: Any) -> tuple[dict[str, Any], list[str]]:
    if not isinstance(value, dict):
        raise BadRequest(f"ExtenderArgs.Nodes: expected a v1.NodeList object, got {_kind(value)}")
    items = value.get("items")
    if items is None:
        items = []
    if not isinstance(items, list):
        raise BadRequest(f"ExtenderArgs.Nodes.items: expected a list, got {_kind(items)}")
    names = []
    for i, item in enumerate(items):
        metadata = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(metadata, dict):
            raise BadRequest(f"ExtenderArgs.Nodes.items[{i}]: expected a v1.Node with metadata")
        names.append(
            _nonempty_string(metadata.get("name"), f"ExtenderArgs.Nodes.items[{i}].metadata.name")
        )
    return value, names


class _NodeCacheArgs(msgspec.Struct):
    """The nodeCacheCapable form, decoded in one typed pass (thousands of names)."""

    Pod: dict[str, Any]
    NodeNames: list[str]
    Nodes: None = None


_node_cache_decoder = msgspec.json.Decoder(_NodeCacheArgs)


def parse_extender_args(body: bytes) -> ExtenderArgs:
    """ExtenderArgs for filter and prioritize: NodeNames (node cache) or Nodes (NodeList)."""
    try:
        fast = _node_cache_decoder.decode(body)
    except UnicodeDecodeError as exc:
        raise _not_utf8(body, "ExtenderArgs") from exc
    except (msgspec.DecodeError, msgspec.ValidationError):
        fast = None  # not the common form, or malformed: the field-by-field path says which
    if fast is not None and "" not in fast.NodeNames:
        return ExtenderArgs(pod=_check_pod(fast.Pod), node_names=fast.NodeNames, node_list=None)
    args = decode_object(body, "ExtenderArgs")
    if "Pod" not in args:
        raise BadRequest("ExtenderArgs.Pod: missing")
    pod = _check_pod(args["Pod"])
    if args.get("NodeNames") is not None:
        return ExtenderArgs(pod=pod, node_names=_node_names(args["NodeNames"]), node_list=None)
    if args.get("Nodes") is not None:
        node_list, names = _node_list(args["Nodes"])
        return ExtenderArgs(pod=pod, node_names=names, node_list=node_list)
    raise BadRequest("ExtenderArgs: give NodeNames (nodeCacheCapable) or Nodes; both are null")


def parse_binding_args(body: bytes) -> BindingArgs:
    args = decode_object(body, "ExtenderBindingArgs")
    return BindingArgs(
        pod_name=_nonempty_string(args.get("PodName"), "ExtenderBindingArgs.PodName"),
        pod_namespace=_nonempty_string(
            args.get("PodNamespace"), "ExtenderBindingArgs.PodNamespace"
        ),
        pod_uid=_nonempty_string(args.get("PodUID"), "ExtenderBindingArgs.PodUID"),
        node=_nonempty_string(args.get("Node"), "ExtenderBindingArgs.Node"),
    )


def filter_result(args: ExtenderArgs, outcome: FilterOutcome, error: str = "") -> dict[str, Any]:
    """ExtenderFilterResult in the form the request used; only input names come back."""
    nodes: dict[str, Any] | None = None
    names: list[str] | None = None
    if args.node_list is None:
        names = list(outcome.passed)
    else:
        passed = set(outcome.passed)
        items = [
            item for item in args.node_list.get("items") or [] if item["metadata"]["name"] in passed
        ]
        nodes = {**args.node_list, "items": items}
    return {
        "Nodes": nodes,
        "NodeNames": names,
        "FailedNodes": outcome.failed,
        "FailedAndUnresolvableNodes": outcome.unresolvable,
        "Error": error,
    }


class HostPriority(msgspec.Struct):
    Host: str
    Score: int


def host_priority_list(scores: dict[str, int]) -> list[HostPriority]:
    """HostPriorityList: [{"Host": ..., "Score": ...}] (Structs encode faster than dicts)."""
    return list(itertools.starmap(HostPriority, scores.items()))  # no Python loop per host


def binding_result(error: str = "") -> dict[str, Any]:
    return {"Error": error}
