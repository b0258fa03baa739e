"""The committed gRPC code matches the .proto files, and method paths are the kubelet's."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

from services.common.kubelet import deviceplugin_v1beta1_pb2 as dp
from services.common.kubelet import podresources_v1_pb2 as pr

ROOT = Path(__file__).resolve().parents[2]
KUBELET = Path("services/common/kubelet")


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_protos.py"), "--out", str(tmp_path)], check=True
    )
    generated = sorted(p.name for p in (tmp_path / KUBELET).iterdir())
    assert generated, "protoc produced nothing"
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / KUBELET, ROOT / KUBELET, generated, shallow=False
    )
    assert not mismatch and not errors, (
        f"regenerate with scripts/gen_protos.py: {mismatch + errors}"
    )


def test_service_and_method_names_match_the_kubelet() -> None:
    plugin = dp.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert plugin.full_name == "v1beta1.DevicePlugin"
    assert [m.name for m in plugin.methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
        "PreStartContainer",
    ]  # fmt: skip
    assert dp.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    assert pr.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"


def test_field_numbers_follow_the_wire_table() -> None:
    response = dp.ContainerAllocateResponse.DESCRIPTOR.fields_by_name
    assert {name: f.number for name, f in response.items()} == {
        "envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5,
    }  # fmt: skip
    request = dp.ContainerPreferredAllocationRequest.DESCRIPTOR.fields_by_name
    assert request["available_deviceIDs"].number == 1
    assert request["must_include_deviceIDs"].number == 2
    assert request["allocation_size"].number == 3
    assert dp.RegisterRequest.DESCRIPTOR.fields_by_name["options"].number == 4
    devices = pr.ContainerResources.DESCRIPTOR.fields_by_name
    assert devices["devices"].number == 2 and devices["dynamic_resources"].number == 5
