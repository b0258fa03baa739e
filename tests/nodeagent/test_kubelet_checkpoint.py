"""The kubelet's device checkpoint: the agent's reader, and the simulator's writer checked
byte for byte against files produced by the kubelet's own encoding (Go encoding/json, and
go-spew 1.1.1 + FNV-1a for the checksum, with the kubelet's checkpoint types)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.nodeagent.kubelet_checkpoint import (
    CheckpointEntry,
    CheckpointError,
    KubeletCheckpoint,
    holders_in,
    parse_checkpoint,
)
from services.simulators import kubelet_checkpoint as sim

R = "nvidia.com/gpu"

# Written by a Go program using the kubelet's checkpoint types, encoding/json and go-spew.
GO_EMPTY = b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":3467439661}'
GO_TWO_ENTRIES = (
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"uid-a","ContainerName":"setup",'
    b'"ResourceName":"nvidia.com/gpu","DeviceIDs":{"0":["GPU-1::0"]},"AllocResp":"CgNB/w=="},'
    b'{"PodUID":"uid-a","ContainerName":"app","ResourceName":"nvidia.com/gpu","DeviceIDs":'
    b'{"-1":["GPU-1::0","GPU-3::1"],"1":["GPU-2::0"],"10":["b"],"2":["a"]},"AllocResp":""}],'
    b'"RegisteredDevices":{"Z/y":["q"],"a.b/c":[],"nvidia.com/gpu":["GPU-1::0","GPU-2::0"]}},'
    b'"Checksum":3383832272}'
)
GO_ESCAPED = (
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"u","ContainerName":"c","ResourceName":"r",'
    b'"DeviceIDs":{},"AllocResp":""}],"RegisteredDevices":{"r":["x \\u003c\\u0026\\u003e '
    b'\\"q\\" \xc3\xa9"]}},"Checksum":2380364319}'
)
# A Kubernetes <= 1.19 kubelet: DeviceIDs a plain list.
V1_LIST_FORM = (
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"uid-old","ContainerName":"init",'
    b'"ResourceName":"nvidia.com/gpu","DeviceIDs":["GPU-1::3","GPU-2::0"],"AllocResp":null}],'
    b'"RegisteredDevices":{"nvidia.com/gpu":["GPU-1::3","GPU-2::0"]}},"Checksum":12}'
)


def test_reads_numa_keyed_device_ids_of_every_entry() -> None:
    entries = parse_checkpoint(GO_TWO_ENTRIES)
    assert entries == (
        CheckpointEntry("uid-a", "setup", R, frozenset({"GPU-1::0"})),
        CheckpointEntry(
            "uid-a", "app", R, frozenset({"GPU-1::0", "GPU-3::1", "GPU-2::0", "a", "b"})
        ),
    )
    assert parse_checkpoint(GO_EMPTY) == ()


def test_reads_the_plain_list_form_of_older_kubelets() -> None:
    (entry,) = parse_checkpoint(V1_LIST_FORM)
    assert entry == CheckpointEntry("uid-old", "init", R, frozenset({"GPU-1::3", "GPU-2::0"}))


def test_unknown_fields_and_nulls_are_tolerated() -> None:
    document = {
        "Data": {
            "PodDeviceEntries": [
                {
                    "PodUID": "u",
                    "ContainerName": "c",
                    "ResourceName": R,
                    "DeviceIDs": {"0": None, "1": ["GPU-1::0"]},
                    "AllocResp": None,
                    "SomethingNew": {"x": 1},
                },
                {"PodUID": "v", "ContainerName": "d", "ResourceName": R, "DeviceIDs": None},
            ],
            "RegisteredDevices": None,
            "Future": [1, 2],
        },
        "Checksum": 1,
        "BootID": "3f1c",
    }
    entries = parse_checkpoint(json.dumps(document).encode())
    assert [e.device_ids for e in entries] == [frozenset({"GPU-1::0"}), frozenset()]


def test_holders_are_entries_of_the_resource_with_exactly_the_ids() -> None:
    entries = parse_checkpoint(GO_TWO_ENTRIES)
    assert [e.container for e in holders_in(entries, R, {"GPU-1::0"})] == ["setup"]
    assert holders_in(entries, "other.io/dev", {"GPU-1::0"}) == []
    assert holders_in(entries, R, {"GPU-1::0", "GPU-2::0"}) == []  # a subset is not a match


@pytest.mark.parametrize("cut", [1, 17, 60, 150, len(GO_TWO_ENTRIES) - 1])
def test_a_truncated_file_is_named_truncated(cut: int) -> None:
    with pytest.raises(CheckpointError, match=r"^kubelet checkpoint /x/ckpt is truncated"):
        parse_checkpoint(GO_TWO_ENTRIES[:cut], "/x/ckpt")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", r"/x/ckpt is empty"),
        (b"  \n", r"/x/ckpt is empty"),
        (b'{"Data": {]}', r"/x/ckpt is not valid JSON: .* line 1 column 11"),
        (b"\xff\xfe{}", r"/x/ckpt is not UTF-8"),
        (b"[]", r"/x/ckpt: expected a JSON object, got a list"),
        (b'{"Checksum": 1}', r"/x/ckpt: Data must be an object, got null"),
        (b'{"Data": []}', r"/x/ckpt: Data must be an object, got a list"),
        (b'{"Data": {}, "Checksum": "12"}', r"Checksum must be a number, got a string"),
        (
            b'{"Data": {"PodDeviceEntries": {}}}',
            r"Data.PodDeviceEntries must be a list, got an object",
        ),
        (b'{"Data": {"PodDeviceEntries": [7]}}', r"PodDeviceEntries\[0\] must be an object"),
    ],
)
def test_malformed_files_get_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        parse_checkpoint(data, "/x/ckpt")


def _entry(**fields: object) -> bytes:
    entry = {"PodUID": "u", "ContainerName": "c", "ResourceName": R, "DeviceIDs": {"0": ["a"]}}
    entry.update(fields)
    return json.dumps({"Data": {"PodDeviceEntries": [entry]}}).encode()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"PodUID": 12}, r"PodUID must be a string, got a number"),
        ({"ContainerName": None}, r"ContainerName must be a string, got null"),
        ({"ResourceName": ["x"]}, r"ResourceName must be a string, got a list"),
        ({"DeviceIDs": "a"}, r"DeviceIDs must be an object keyed by NUMA node or a list"),
        ({"DeviceIDs": {"zero": ["a"]}}, r"DeviceIDs key 'zero' is not a NUMA node id"),
        ({"DeviceIDs": {"0": [1]}}, r"DeviceIDs\['0'\] must be a list of strings"),
        ({"DeviceIDs": [True]}, r"DeviceIDs must be a list of strings"),
    ],
)
def test_wrong_types_in_an_entry_get_a_clear_error(fields: dict[str, object], message: str) -> None:
    where = r"kubelet checkpoint /x/ckpt: PodDeviceEntries\[0\]: "
    with pytest.raises(CheckpointError, match=where + message):
        parse_checkpoint(_entry(**fields), "/x/ckpt")


def _replace(path: Path, data: bytes) -> None:
    """As the kubelet: a temporary file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_file_reader_missing_file_errors_and_changes(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    checkpoint = KubeletCheckpoint(path)
    assert checkpoint.entries() == ()  # no file yet: nothing allocated

    _replace(path, b'{"Data": {"PodDeviceEntries": [')
    for _ in range(2):  # the same clear error until the file changes
        with pytest.raises(CheckpointError, match=f"{path} is truncated"):
            checkpoint.entries()

    _replace(path, GO_TWO_ENTRIES)
    assert [e.container for e in checkpoint.holders(R, {"GPU-1::0"})] == ["setup"]
    first = checkpoint.entries()
    assert checkpoint.entries() is first  # unchanged file: not parsed again

    _replace(path, V1_LIST_FORM)
    assert [e.pod_uid for e in checkpoint.entries()] == ["uid-old"]
    path.unlink()
    assert checkpoint.entries() == ()


def test_unreadable_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"cannot read kubelet checkpoint {tmp_path}"):
        KubeletCheckpoint(tmp_path).entries()  # a directory


# -- the simulator's writer ----------------------------------------------------------------


def test_simulator_encodes_exactly_as_the_kubelet() -> None:
    assert sim.encode_checkpoint([], {}) == GO_EMPTY
    entries = [
        sim.CheckpointEntry("uid-a", "setup", R, {0: ["GPU-1::0"]}, bytes([10, 3, 0x41, 0xFF])),
        sim.CheckpointEntry(
            "uid-a",
            "app",
            R,
            {1: ["GPU-2::0"], -1: ["GPU-1::0", "GPU-3::1"], 10: ["b"], 2: ["a"]},
            b"",
        ),
    ]
    registered = {"nvidia.com/gpu": ["GPU-1::0", "GPU-2::0"], "a.b/c": [], "Z/y": ["q"]}
    assert sim.encode_checkpoint(entries, registered) == GO_TWO_ENTRIES
    escaped = [sim.CheckpointEntry("u", "c", "r", {}, b"")]
    assert sim.encode_checkpoint(escaped, {"r": ['x <&> "q" é']}) == GO_ESCAPED


def test_devices_are_grouped_per_numa_node_as_the_kubelet_does() -> None:
    grouped = sim.devices_per_numa({"a": [0], "b": [], "c": [0, 1], "d": [1]})
    assert grouped == {0: ["a", "c"], -1: ["b"], 1: ["c", "d"]}
