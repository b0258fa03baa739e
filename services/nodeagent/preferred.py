"""Which device IDs to suggest to the kubelet (GetPreferredAllocation).

The allocator knows which GPUs it chose for the next container landing on this node; the
plugin turns that GPU list into device IDs. Without a usable hint it spreads the pick over
distinct GPUs. Either way the kubelet treats the answer as a hint only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import GpuDevice, GpuSlice, PreferredReply, PreferredRequest
from services.nodeagent.catalog import UnknownDeviceError
from services.nodeagent.device_ids import parse_device_id
from services.nodeagent.grant import container_key

log = logging.getLogger("vgpu.nodeagent")

GpuOf = Callable[[str], GpuDevice]
MAX_REMEMBERED_HINTS = 256


def _known(device_ids: list[str], gpu_of: GpuOf) -> dict[str, GpuDevice]:
    """Map IDs to their GPUs, dropping IDs this node does not advertise."""
    known: dict[str, GpuDevice] = {}
    for device_id in device_ids:
        try:
            known[device_id] = gpu_of(device_id)
        except UnknownDeviceError:
            log.warning("kubelet offered an unknown device ID", extra={"device_id": device_id})
    return known


def _by_replica(device_ids: list[str]) -> list[str]:
    return sorted(device_ids, key=lambda device_id: parse_device_id(device_id).replica)


def available_gpus(available: list[str], gpu_of: GpuOf) -> list[str]:
    """UUIDs of GPUs with at least one available ID, in GPU index order."""
    gpus = {gpu.uuid: gpu for gpu in _known(available, gpu_of).values()}
    return [gpu.uuid for gpu in sorted(gpus.values(), key=lambda gpu: gpu.index)]


def pick_on_gpus(
    available: list[str], must_include: list[str], size: int, gpu_uuids: list[str], gpu_of: GpuOf
) -> list[str] | None:
    """One ID per hinted GPU (lowest replica first), after `must_include`; None if the hint
    cannot give exactly `size` IDs."""
    known = _known(available, gpu_of)
    chosen = [device_id for device_id in must_include if device_id in known]
    used = {known[device_id].uuid for device_id in chosen}
    for gpu_uuid in gpu_uuids:
        if len(chosen) >= size:
            break
        if gpu_uuid in used:
            continue
        on_gpu = [d for d, gpu in known.items() if gpu.uuid == gpu_uuid and d not in chosen]
        if not on_gpu:
            return None
        chosen.append(_by_replica(on_gpu)[0])
        used.add(gpu_uuid)
    return chosen if len(chosen) == size else None


def spread_pick(
    available: list[str], must_include: list[str], size: int, gpu_of: GpuOf
) -> list[str]:
    """`must_include`, then one ID per distinct GPU, then second IDs, ...; within a round the
    least-shared GPU (the fewest of its IDs taken; without a known count, the most available)
    first, then index order. Without a hint every container would otherwise pile onto GPU 0
    until its IDs run out."""
    known = _known(available, gpu_of)
    chosen = [device_id for device_id in must_include if device_id in known][:size]
    used = {known[device_id].uuid for device_id in chosen}
    free_on_gpu: dict[str, int] = {}
    for gpu in known.values():
        free_on_gpu[gpu.uuid] = free_on_gpu.get(gpu.uuid, 0) + 1
    seen_on_gpu: dict[str, int] = {}
    ranked: list[tuple[int, int, int, str]] = []
    for device_id in _by_replica([d for d in known if d not in chosen]):
        gpu = known[device_id]
        position = seen_on_gpu.get(gpu.uuid, 0)
        seen_on_gpu[gpu.uuid] = position + 1
        # A GPU already holding a must_include ID joins from the second round on.
        free = free_on_gpu[gpu.uuid]
        shared = gpu.replicas - free if gpu.replicas else -free
        ranked.append((position + (gpu.uuid in used), shared, gpu.index, device_id))
    chosen.extend(device_id for *_, device_id in sorted(ranked)[: size - len(chosen)])
    return chosen


class PreferenceAdvisor:
    """Asks the allocator for a GPU hint, bounded in time; falls back to `spread_pick`."""

    def __init__(self, bus: Bus, node_name: str, gpu_of: GpuOf, timeout_s: float = 1.0) -> None:
        self._bus = bus
        self._node = node_name
        self._gpu_of = gpu_of
        self._timeout_s = timeout_s
        # The allocator's slices for the IDs it hinted, by container key, so Allocate (which
        # names no pod) can set an MPS client's share. Bounded: hints not followed age out.
        self._hinted: OrderedDict[str, list[GpuSlice]] = OrderedDict()

    def hinted_slices(self, device_ids: list[str]) -> list[GpuSlice] | None:
        """The allocator's slices for exactly these IDs, when it hinted them."""
        return self._hinted.get(container_key(device_ids))

    def _remember(self, picked: list[str], slices: list[GpuSlice]) -> None:
        if not slices:
            return
        self._hinted[container_key(picked)] = list(slices)
        while len(self._hinted) > MAX_REMEMBERED_HINTS:
            self._hinted.popitem(last=False)

    async def choose(
        self, available: list[str], must_include: list[str], size: int
    ) -> tuple[list[str], str]:
        """The IDs to suggest, and where they came from: "allocator" or "fallback"."""
        gpus = available_gpus(available, self._gpu_of)
        hint: list[str] = []
        slices: list[GpuSlice] = []
        try:
            reply = await self._bus.request(
                subjects.ALLOC_PREFERRED,
                PreferredRequest(node=self._node, available_gpus=gpus, size=size),
                PreferredReply,
                timeout=self._timeout_s,
            )
            hint = reply.gpu_uuids
            slices = reply.slices
        except Exception as exc:  # any failure to get a hint means: pick ourselves
            log.info(
                "no preferred-allocation hint from the allocator",
                extra={"node": self._node, "error": str(exc)},
            )
        if hint:
            picked = pick_on_gpus(available, must_include, size, hint, self._gpu_of)
            if picked is not None:
                self._remember(picked, slices)
                return picked, "allocator"
            log.warning(
                "allocator hint does not fit the available devices",
                extra={"node": self._node, "hint": hint, "size": size},
            )
        return spread_pick(available, must_include, size, self._gpu_of), "fallback"
