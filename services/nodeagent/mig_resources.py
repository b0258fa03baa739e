"""Which resource each GPU and MIG device is advertised under, per MIG strategy, as NVIDIA's
device plugin names them (flags.migStrategy):

| strategy | GPUs with MIG off | GPUs with MIG on |
|---|---|---|
| none | resource_name (vgpu slices) | resource_name too, whole (vgpu does not slice them) |
| single | refused: every GPU must be in MIG mode | every MIG device as resource_name |
| mixed | resource_name (vgpu slices) | nvidia.com/mig-<profile> per profile |

Under single, NVIDIA's rules hold: all GPUs in MIG mode, each with MIG devices, all of one
profile; otherwise MigStrategyError says which rule broke. GPUs marked for dynamic MIG stay
under resource_name (the allocator places memory requests on them by MIG geometry).

Under mixed, the GPU-sharing fork's MIG rules (`mig-3g.20gb:small:2`, resource_config.py)
rename a profile's resource (`nvidia.com/small`) and give each of its MIG devices REPLICAS
device IDs (`MIG-<uuid>::<n>` when more than one), as time-slicing does for whole GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from services.common import mig
from services.common.schemas import GpuDevice, MigDevice
from services.nodeagent.device_ids import SEPARATOR
from services.nodeagent.labels import label_value
from services.nodeagent.resource_config import ResourceRule


class MigStrategyError(ValueError):
    pass


@dataclass(frozen=True)
class MigEntry:
    device: MigDevice
    parent: GpuDevice
    replicas: int = 1  # device IDs the kubelet sees for it (resource_config's REPLICAS)

    @property
    def healthy(self) -> bool:
        return self.device.healthy and self.parent.healthy

    def device_ids(self) -> list[str]:
        """The MIG UUID itself, or `<MIG uuid>::<n>` per replica when it is shared."""
        if self.replicas == 1:
            return [self.device.uuid]
        return [f"{self.device.uuid}{SEPARATOR}{n}" for n in range(self.replicas)]


def mig_uuid_of(device_id: str) -> str:
    """The MIG device a device ID names (a replica's or the plain MIG UUID)."""
    return device_id.partition(SEPARATOR)[0]


def mig_renames(rules: Iterable[ResourceRule]) -> dict[str, ResourceRule]:
    """resource_config's MIG rules by the resource NVIDIA's mixed strategy would use:
    {"nvidia.com/mig-3g.20gb": rule}."""
    return {
        mig.resource_name(rule.source.removeprefix("mig-")): rule for rule in rules if rule.is_mig
    }


def parse_dynamic(text: str) -> tuple[int, ...] | None:
    """GPU indices of `mig_dynamic`: None for "all", () for ""; ValueError otherwise."""
    text = text.strip()
    if text == "all":
        return None
    indices = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"mig_dynamic: {part!r} is not a GPU index (expected all or 0,1)")
        indices.append(int(part))
    return tuple(indices)


def mark_dynamic(gpus: list[GpuDevice], selection: tuple[int, ...] | None) -> list[GpuDevice]:
    """The GPUs with `mig_dynamic` set on those selected that support MIG."""
    return [
        msgspec.structs.replace(gpu, mig_dynamic=True)
        if mig.mig_capable(gpu.model) and (selection is None or gpu.index in selection)
        else gpu
        for gpu in gpus
    ]


def static_mig(gpu: GpuDevice) -> bool:
    """A GPU whose MIG devices the static strategies advertise."""
    return gpu.mig_mode and not gpu.mig_dynamic


def slice_served(gpu: GpuDevice, strategy: str) -> bool:
    """Whether vgpu's own (sliced) resource lists this GPU."""
    if strategy == "single":
        return False
    if strategy == "mixed":
        return not static_mig(gpu)
    return True


def check_single(gpus: list[GpuDevice]) -> None:
    """NVIDIA's single-strategy rules, MigStrategyError naming the one broken."""
    off = [gpu.index for gpu in gpus if not gpu.mig_mode]
    if off:
        raise MigStrategyError(
            f"mig_strategy single: all GPUs must have the same migEnabled value; GPU(s) "
            f"{off} have MIG off"
        )
    empty = [gpu.index for gpu in gpus if not gpu.mig_devices]
    if empty:
        raise MigStrategyError(
            f"mig_strategy single: MIG-enabled GPU(s) {empty} have no MIG devices"
        )
    profiles = sorted({(m.profile, m.memory_mib) for gpu in gpus for m in gpu.mig_devices})
    if len(profiles) > 1:
        names = ", ".join(profile for profile, _ in profiles)
        raise MigStrategyError(
            f"mig_strategy single: more than one MIG device type present on node ({names})"
        )


def mig_resources(
    gpus: list[GpuDevice],
    strategy: str,
    base_resource: str,
    renames: dict[str, ResourceRule] | None = None,
) -> dict[str, list[MigEntry]]:
    """{resource: its MIG devices}. Under mixed every profile the node's MIG GPUs support
    is listed, empty or not (so a resource stays registered while geometry changes), under
    its `renames` rule's name and replicas when it has one (mig_renames); MIG devices split
    into smaller compute instances match no profile and are left out, as NVIDIA's device map
    cannot name them."""
    if strategy == "single":
        check_single(gpus)
        return {base_resource: [MigEntry(m, gpu) for gpu in gpus for m in gpu.mig_devices]}
    if strategy != "mixed":
        return {}
    renames = renames or {}

    def advertised(profile: str) -> tuple[str, int]:
        default = mig.resource_name(profile)
        rule = renames.get(default)
        return (default, 1) if rule is None else (rule.resource, rule.replicas)

    found: dict[str, list[MigEntry]] = {}
    for gpu in gpus:
        if not static_mig(gpu):
            continue
        profiles = [profile.name for profile in mig.profiles_for(gpu.model)]
        for profile in profiles:
            found.setdefault(advertised(profile)[0], [])
        for device in gpu.mig_devices:
            if device.profile in profiles:
                resource, replicas = advertised(device.profile)
                found[resource].append(MigEntry(device, gpu, replicas))
    return found


MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"


def mig_labels(gpus: list[GpuDevice], strategy: str) -> dict[str, str]:
    """GPU Feature Discovery's MIG labels, on nodes with a GPU in MIG mode: the strategy;
    under mixed, per advertised profile `nvidia.com/mig-<profile>.count`, `.memory` (MiB)
    and `.multiprocessors`; under single, the product `<model>-MIG-<profile>` with the MIG
    devices' count and memory (`<model>-MIG-INVALID` and count 0 when the rules break)."""
    if not any(gpu.mig_mode for gpu in gpus):
        return {}
    labels = {MIG_STRATEGY_LABEL: strategy}
    if strategy == "single":
        model = gpus[0].model
        try:
            entries = mig_resources(gpus, strategy, "nvidia.com/gpu")["nvidia.com/gpu"]
        except MigStrategyError:
            labels.update(
                {
                    "nvidia.com/gpu.product": label_value(f"{model}-MIG-INVALID"),
                    "nvidia.com/gpu.count": "0",
                }
            )
            return labels
        first = entries[0].device
        labels.update(
            {
                # NVML's names have spaces ("NVIDIA A100-SXM4-40GB"): label-safe, as GFD
                "nvidia.com/gpu.product": label_value(f"{model}-MIG-{first.profile}"),
                "nvidia.com/gpu.count": str(len(entries)),
                "nvidia.com/gpu.memory": str(first.memory_mib),
            }
        )
    elif strategy == "mixed":
        for resource, entries in mig_resources(gpus, strategy, "nvidia.com/gpu").items():
            if not entries:
                continue
            device = entries[0].device
            labels[f"{resource}.count"] = str(len(entries))
            labels[f"{resource}.memory"] = str(device.memory_mib)
            labels[f"{resource}.multiprocessors"] = str(device.sm_count)
    return labels
