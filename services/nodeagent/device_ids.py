"""Device IDs the plugin advertises: `<gpu-uuid>::<n>`, n in 0..split_count-1.

The ID names its physical GPU, so the kubelet's checkpoint and the PodResources API tell
which GPU a container holds without asking vgpu.
"""

from __future__ import annotations

from typing import NamedTuple

SEPARATOR = "::"
MAX_LENGTH = 63  # the kubelet rejects longer device IDs


class DeviceIdError(ValueError):
    pass


class DeviceId(NamedTuple):
    gpu_uuid: str
    replica: int

    def __str__(self) -> str:
        return f"{self.gpu_uuid}{SEPARATOR}{self.replica}"


def make_device_id(gpu_uuid: str, replica: int) -> str:
    if not gpu_uuid or SEPARATOR in gpu_uuid:
        raise DeviceIdError(f"GPU uuid {gpu_uuid!r} cannot be part of a device ID")
    if replica < 0:
        raise DeviceIdError(f"replica number must not be negative, got {replica}")
    device_id = str(DeviceId(gpu_uuid, replica))
    if len(device_id) > MAX_LENGTH:
        raise DeviceIdError(f"device ID {device_id!r} is longer than {MAX_LENGTH} characters")
    return device_id


def parse_device_id(device_id: str) -> DeviceId:
    gpu_uuid, sep, replica = device_id.rpartition(SEPARATOR)
    if not sep or not gpu_uuid or not replica.isdigit():
        raise DeviceIdError(f"bad device ID {device_id!r}: expected <gpu-uuid>::<n>")
    return DeviceId(gpu_uuid, int(replica))
