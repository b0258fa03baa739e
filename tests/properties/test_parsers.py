"""Every parser of outside input either returns a value the rest of vgpu can use or raises its
one documented error, whatever the bytes: the extender's ExtenderArgs and ExtenderBindingArgs,
the webhook's AdmissionReview, pod specs (every request syntax and annotation), the relay's
hook lines and every NATS payload type. Anything else (a KeyError, a TypeError deep in the
engine) would be a 500, a dead connection or an uncounted drop."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.allocator.pod_request import PodRequest, parse_pod
from services.allocator.policies import POLICIES
from services.allocator.webhook import BadReview, review
from services.allocator.wire import BadRequest, parse_binding_args, parse_extender_args
from services.common import schemas
from services.common.quantity import QuantityError
from services.common.resources import RequestConfig, RequestError
from services.nodeagent.relay_protocol import Exit, Hello, RelayProtocolError, Usage, decode_line
from tests.properties.strategies import JSON, pods

FAST = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)  # fmt: skip
BYTES = st.binary(max_size=300)


def encoded(value: Any) -> bytes:
    return json.dumps(value).encode()


# -- the scheduler extender ----------------------------------------------------------------


@FAST
@given(st.one_of(BYTES, JSON.map(encoded)))
def test_extender_args_from_any_bytes(body: bytes) -> None:
    try:
        args = parse_extender_args(body)
    except BadRequest as exc:
        assert str(exc)
        return
    assert isinstance(args.pod, dict) and isinstance(args.pod["metadata"]["name"], str)
    assert all(isinstance(n, str) and n for n in args.node_names)


@FAST
@given(pods(), st.one_of(st.lists(st.text(max_size=6), max_size=4), JSON), st.booleans())
def test_extender_args_around_a_pod(pod: dict[str, Any], names: Any, as_list: bool) -> None:
    body: dict[str, Any] = {"Pod": pod}
    if as_list:
        body["Nodes"] = (
            {"items": [{"metadata": {"name": n}} for n in names]}
            if isinstance(names, list)
            else names
        )
    else:
        body["NodeNames"] = names
    try:
        args = parse_extender_args(encoded(body))
    except BadRequest as exc:
        assert "ExtenderArgs" in str(exc) or "JSON" in str(exc)  # names the field
        return
    assert all(isinstance(n, str) and n for n in args.node_names)


@FAST
@given(st.one_of(BYTES, JSON.map(encoded)))
def test_binding_args_from_any_bytes(body: bytes) -> None:
    try:
        args = parse_binding_args(body)
    except BadRequest as exc:
        assert str(exc)
        return
    assert all(isinstance(v, str) and v for v in vars(args).values())


# -- pod specs and the admission webhook --------------------------------------------------


@FAST
@given(pods())
def test_pod_requests_or_a_named_error(pod: dict[str, Any]) -> None:
    try:
        request = parse_pod(pod, frozenset(POLICIES))
    except (RequestError, QuantityError) as exc:
        assert str(exc)
        return
    assert isinstance(request, PodRequest)
    for container in request.containers:
        assert container.gpus >= 0 and container.memory_mib >= 0
        assert 0 <= container.cores <= 100


@FAST
@given(pods(), st.sampled_from(["CREATE", "UPDATE", None]))
def test_admission_review_of_any_pod(pod: dict[str, Any], operation: Any) -> None:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "r", "operation": operation, "object": pod},
    }
    answer = review(encoded(body), RequestConfig(), "vgpu-scheduler", cpu_pods=True)
    response = answer["response"]
    assert response["uid"] == "r" and isinstance(response["allowed"], bool)
    if not response["allowed"]:
        assert response["status"]["message"]  # a denial says why


@FAST
@given(st.one_of(BYTES, JSON.map(encoded)))
def test_admission_review_from_any_bytes(body: bytes) -> None:
    try:
        review(body, RequestConfig(), "vgpu-scheduler")
    except BadReview as exc:
        assert str(exc)


# -- the relay (hook -> agent lines) --------------------------------------------------------

HOOK_LINE = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 2, "1"]), "type": st.sampled_from(["hello", "usage", "exit", "x"])},
    optional={
        "pid": JSON | st.integers(-5, 2**40),
        "comm": JSON,
        "ts_ms": JSON | st.integers(0, 2**64),
        "devices": st.lists(
            st.dictionaries(
                st.sampled_from(["index", "uuid", "limit_mib", "cores", "used_mib",
                                 "process_used_mib"]),
                JSON | st.integers(-1, 2**64),
            ),
            max_size=3,
        ) | JSON,
        "launches": JSON | st.integers(0, 2**64),
        "throttled_ms": JSON | st.integers(0, 2**64),
    },
)  # fmt: skip


@FAST
@given(st.one_of(BYTES, HOOK_LINE.map(encoded), JSON.map(encoded)))
def test_relay_line_decodes_or_is_refused_with_a_reason(line: bytes) -> None:
    try:
        message = decode_line(line)
    except RelayProtocolError as exc:
        assert exc.reason in ("oversized", "malformed", "not_utf8") and str(exc)
        return
    assert isinstance(message, Hello | Usage | Exit) and message.v == 1


def test_relay_line_over_the_limit_is_oversized() -> None:
    with pytest.raises(RelayProtocolError) as caught:
        decode_line(b'{"v":1,"type":"exit","pid":1,"pad":"' + b"x" * 5000 + b'"}')
    assert caught.value.reason == "oversized"


# -- NATS payloads ----------------------------------------------------------------------------

PAYLOAD_TYPES = [
    t
    for t in vars(schemas).values()
    if isinstance(t, type) and issubclass(t, msgspec.Struct) and t.__module__ == schemas.__name__
]


@pytest.mark.parametrize("payload_type", PAYLOAD_TYPES, ids=lambda t: t.__name__)
@FAST
@given(body=st.one_of(BYTES, JSON.map(encoded)))
def test_nats_payload_decodes_or_raises_decode_error(payload_type: type, body: bytes) -> None:
    """The bus drops (and counts) exactly msgspec.DecodeError; nothing else may escape."""
    try:
        value = msgspec.json.decode(body, type=payload_type)
    except msgspec.DecodeError:
        return
    assert msgspec.json.decode(msgspec.json.encode(value), type=payload_type) == value
