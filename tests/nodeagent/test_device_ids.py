from __future__ import annotations

import pytest

from services.nodeagent.catalog import DeviceCatalog, UnknownDeviceError
from services.nodeagent.device_ids import DeviceIdError, make_device_id, parse_device_id
from services.nodeagent.gpus.simulated import SimulatedGpuBackend

UUID = "GPU-0f0e0d0c-0b0a-0908-0706-050403020100"


def test_round_trip() -> None:
    device_id = make_device_id(UUID, 7)
    assert device_id == f"{UUID}::7"
    assert parse_device_id(device_id) == (UUID, 7)
    assert len(device_id) <= 63


@pytest.mark.parametrize("bad", ["", "GPU-x", "GPU-x::", "::3", "GPU-x::-1", "GPU-x::a", "GPU-x:3"])
def test_bad_ids_are_named(bad: str) -> None:
    with pytest.raises(DeviceIdError, match=f"bad device ID {bad!r}: expected <gpu-uuid>::<n>"):
        parse_device_id(bad)


def test_cannot_make_ids_that_would_not_parse() -> None:
    with pytest.raises(DeviceIdError):
        make_device_id("GPU::x", 0)
    with pytest.raises(DeviceIdError):
        make_device_id(UUID, -1)
    with pytest.raises(DeviceIdError, match="longer than 63"):
        make_device_id("GPU-" + "x" * 60, 0)


def test_catalog_maps_ids_to_gpus_and_refuses_others() -> None:
    gpus = SimulatedGpuBackend("n", "2xT4").devices()
    catalog = DeviceCatalog(gpus, split_count=3)
    ids = [d.device_id for d in catalog.devices()]
    assert ids == [f"{g.uuid}::{n}" for g in gpus for n in range(3)]
    assert catalog.gpu_of(f"{gpus[1].uuid}::2") == gpus[1]
    with pytest.raises(UnknownDeviceError, match="not advertised here"):
        catalog.gpu_of(f"{gpus[1].uuid}::3")  # beyond split_count
    with pytest.raises(UnknownDeviceError, match="not advertised here"):
        catalog.gpu_of(f"{UUID}::0")
    with pytest.raises(UnknownDeviceError, match="bad device ID"):
        catalog.gpu_of("garbage")


async def test_catalog_wakes_watchers_on_change_and_on_close() -> None:
    backend = SimulatedGpuBackend("n", "2xT4")
    catalog = DeviceCatalog(backend.devices(), split_count=1)
    assert not await catalog.update(backend.devices())  # same view: no change
    seen = catalog.generation
    backend.set_healthy(backend.devices()[0].uuid, False)
    assert await catalog.update(backend.devices())
    assert await catalog.wait_for_change(seen) is True
    await catalog.close()
    assert await catalog.wait_for_change(catalog.generation) is False
