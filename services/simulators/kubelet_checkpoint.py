"""The device manager's checkpoint file, written as the kubelet writes it.

`<plugin_dir>/kubelet_internal_checkpoint` is Go's encoding/json of

    {"Data": {"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName",
                                    "DeviceIDs": {"<numa>": [ids]}, "AllocResp": base64}],
              "RegisteredDevices": {"<resource>": [healthy ids]}},
     "Checksum": N}

rewritten (temporary file, fsync, rename) after every container's Allocate, init containers
included. The checksum is the kubelet's: FNV-1a (32 bit) of go-spew's `%#v` rendering of the
Data struct (config: SortKeys, SpewKeys, DisableMethods, DisablePointerAddresses,
DisableCapacities), which spells the Go type names of the kubelet's `checkpoint` package.
`_spew_data` reproduces that rendering for exactly these types.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

CHECKPOINT_FILE = "kubelet_internal_checkpoint"
NO_TOPOLOGY = -1  # the kubelet's NUMA key for devices without topology

# Go's encoding/json escapes these even inside strings; the checksum does not depend on it.
_GO_JSON_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


@dataclass(frozen=True)
class CheckpointEntry:
    pod_uid: str
    container: str
    resource: str
    devices: Mapping[int, list[str]]  # NUMA node -> device IDs, as the kubelet groups them
    alloc_resp: bytes  # the plugin's ContainerAllocateResponse, protobuf-encoded


def devices_per_numa(devices: Mapping[str, list[int]]) -> dict[int, list[str]]:
    """device ID -> its NUMA nodes, regrouped per NUMA node (-1: no topology)."""
    grouped: dict[int, list[str]] = {}
    for device_id, nodes in devices.items():
        for numa in nodes or [NO_TOPOLOGY]:
            grouped.setdefault(numa, []).append(device_id)
    return grouped


def _spew_strings(values: list[str] | None) -> str:
    return "<nil>" if values is None else "[" + " ".join(values) + "]"


def _spew_data(entries: list[CheckpointEntry], registered: Mapping[str, list[str]]) -> str:
    """go-spew's `%#v` of checkpoint.checkpointData. Struct fields print their type, slice
    elements and map keys/values do not; map keys are sorted; a nil slice is `<nil>`."""
    rendered = []
    for e in entries:
        numa = " ".join(f"{n}:{_spew_strings(e.devices[n])}" for n in sorted(e.devices))
        rendered.append(
            f"{{PodUID:(string){e.pod_uid} ContainerName:(string){e.container} "
            f"ResourceName:(string){e.resource} DeviceIDs:(checkpoint.DevicesPerNUMA)map[{numa}] "
            f"AllocResp:([]uint8)[{' '.join(str(b) for b in e.alloc_resp)}]}}"
        )
    devices = " ".join(f"{r}:{_spew_strings(registered[r])}" for r in sorted(registered))
    # The kubelet hands over a nil slice when nothing is allocated.
    listed = "[" + " ".join(rendered) + "]" if entries else "<nil>"
    return (
        f"(checkpoint.checkpointData){{PodDeviceEntries:([]checkpoint.PodDevicesEntry){listed} "
        f"RegisteredDevices:(map[string][]string)map[{devices}]}}"
    )


def kubelet_checksum(entries: list[CheckpointEntry], registered: Mapping[str, list[str]]) -> int:
    digest = 0x811C9DC5  # FNV-1a, 32 bit
    for byte in _spew_data(entries, registered).encode("utf-8"):
        digest = ((digest ^ byte) * 0x01000193) & 0xFFFFFFFF
    return digest


def encode_checkpoint(entries: list[CheckpointEntry], registered: Mapping[str, list[str]]) -> bytes:
    document = {
        "Data": {
            "PodDeviceEntries": [
                {
                    "PodUID": e.pod_uid,
                    "ContainerName": e.container,
                    "ResourceName": e.resource,
                    # Go sorts map keys by their text, so "-1" < "0" < "10" < "2".
                    "DeviceIDs": {str(n): e.devices[n] for n in sorted(e.devices, key=str)},
                    "AllocResp": base64.b64encode(e.alloc_resp).decode("ascii"),
                }
                for e in entries
            ]
            or None,
            "RegisteredDevices": {r: registered[r] for r in sorted(registered)},
        },
        "Checksum": kubelet_checksum(entries, registered),
    }
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    return text.translate(_GO_JSON_ESCAPES).encode("utf-8")


class DeviceCheckpoint:
    """The simulated kubelet's device assignments, mirrored into the checkpoint file."""

    def __init__(self, path: Path, registered: Callable[[], Mapping[str, list[str]]]) -> None:
        self.path = path
        self._registered = registered  # resource -> healthy device IDs, at write time
        self._entries: dict[tuple[str, str, str], CheckpointEntry] = {}

    def entries(self) -> list[CheckpointEntry]:
        return list(self._entries.values())

    def allocated(self, entry: CheckpointEntry) -> None:
        """Record one container's devices of one resource and write the file (OSError when
        it cannot be written, which fails the admission as in the kubelet)."""
        self._entries[(entry.pod_uid, entry.container, entry.resource)] = entry
        self.write()

    def forget(self, keys: list[tuple[str, str, str]]) -> None:
        """Drop entries (pod_uid, container, resource) and rewrite the file if any were held."""
        removed = [self._entries.pop(key, None) for key in keys]
        if any(entry is not None for entry in removed):
            self.write()

    def forget_pod(self, pod_uid: str) -> None:
        self.forget([key for key in self._entries if key[0] == pod_uid])

    def write(self) -> None:
        data = encode_checkpoint(self.entries(), self._registered())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
