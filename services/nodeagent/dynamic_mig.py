"""Dynamic MIG on the node: MIG instances made for a container before Allocate answers, and
destroyed once no pod uses them.

The allocator decides the profile and the start slice when it places the pod (it sees every
GPU's MIG geometry in the inventory); the kubelet's Allocate brings only device IDs, so the
agent asks the allocator which placement awaits on that GPU (`alloc.mig`, answered with the
oldest bound container not yet served, the same rule as the preferred-allocation hint),
creates the GPU instance there and one compute instance spanning it through NVML, and hands
the container the new MIG device's UUID instead of the GPU's. A kubelet retrying Allocate for
the same container (same device IDs, same key) gets the same instance back.

The instances go when the allocator releases the pod (its `released` event) or when the
container's directory is removed (the janitor's backstop); a refused destroy (processes still
on it) is retried at the next of those. Which instance is whose is kept in the agent's state
directory (`dynamic-mig.json`, never mounted into a container), so a restarted agent still
destroys what it made; a recorded instance that no longer exists is forgotten.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from prometheus_client import Counter, Histogram

from services.common import subjects
from services.common.bus import Bus, BusError
from services.common.schemas import GpuDevice, MigPrepareReply, MigPrepareRequest
from services.nodeagent.files import atomic_write_bytes
from services.nodeagent.gpus.backend import MigControl
from services.nodeagent.grant import CDI_ANNOTATION_PREFIX, VISIBLE_DEVICES_ENV, ContainerGrant

log = logging.getLogger("vgpu.nodeagent")

MIG_INSTANCES = Counter(
    "vgpu_nodeagent_dynamic_mig_instances_total",
    "Dynamic MIG instances by what happened to them",
    ["node", "profile", "action"],  # created | destroyed | failed
)
MIG_CREATE_SECONDS = Histogram(
    "vgpu_nodeagent_dynamic_mig_create_seconds",
    "Time to obtain the placement and create a dynamic MIG instance, in Allocate",
    ["node"],
)


class DynamicMigError(Exception):
    """Allocate cannot be served on a dynamic-MIG GPU; the message says why."""


RECORD_FILE = "dynamic-mig.json"


class MigInstance(msgspec.Struct, frozen=True, kw_only=True):
    gpu_uuid: str
    gi_id: int
    ci_id: int
    mig_uuid: str
    profile: str
    pod_uid: str
    pod: str  # namespace/name, for logs


class DynamicMig:
    def __init__(
        self,
        *,
        node_name: str,
        backend: MigControl,
        bus: Bus,
        gpus: Callable[[], list[GpuDevice]],
        on_change: Callable[[], Awaitable[object]],
        timeout_s: float = 5.0,
        state_dir: Path | None = None,
    ) -> None:
        self._record = None if state_dir is None else state_dir / RECORD_FILE
        self._node = node_name
        self._backend = backend
        self._bus = bus
        self._gpus = gpus
        self._on_change = on_change
        self._timeout_s = timeout_s
        self._instances: dict[str, list[MigInstance]] = {}  # container key -> its instances
        self._lock = asyncio.Lock()  # one geometry change at a time

    def instances(self) -> dict[str, list[MigInstance]]:
        return {key: list(made) for key, made in self._instances.items()}

    def restore(self) -> int:
        """Take back the record of an earlier run: instances that still exist (how many)."""
        if self._record is None or not self._record.exists():
            return 0
        try:
            recorded = msgspec.json.decode(
                self._record.read_bytes(), type=dict[str, list[MigInstance]]
            )
        except (OSError, msgspec.DecodeError) as exc:
            log.error(
                "unreadable dynamic MIG record; its instances are left as they are",
                extra={"node": self._node, "path": str(self._record), "error": str(exc)},
            )
            return 0
        live: dict[str, set[str]] = {}
        for key, made in recorded.items():
            kept = []
            for instance in made:
                if instance.gpu_uuid not in live:
                    try:
                        devices = self._backend.mig_devices(instance.gpu_uuid)
                    except ValueError:
                        devices = []
                    live[instance.gpu_uuid] = {d.uuid for d in devices}
                if instance.mig_uuid in live[instance.gpu_uuid]:
                    kept.append(instance)
            if kept:
                self._instances[key] = kept
        count = sum(len(made) for made in self._instances.values())
        log.info("dynamic MIG instances restored", extra={"node": self._node, "instances": count})
        return count

    def _save(self) -> None:
        if self._record is None:
            return
        try:
            self._record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self._record, msgspec.json.encode(self._instances), mode=0o600)
        except OSError as exc:  # serving matters more than the record: say so and go on
            log.error(
                "cannot record dynamic MIG instances",
                extra={"node": self._node, "path": str(self._record), "error": str(exc)},
            )

    def serves(self, grant: ContainerGrant) -> bool:
        dynamic = {gpu.uuid for gpu in self._gpus() if gpu.mig_dynamic}
        return any(uuid in dynamic for uuid in grant.gpu_uuids)

    async def prepare(self, grant: ContainerGrant) -> ContainerGrant:
        """The grant with each dynamic GPU replaced by a MIG device made for it."""
        started = time.monotonic()
        async with self._lock:
            made = self._instances.get(grant.key)
            if made is None:
                made = await self._create_all(grant)
                self._instances[grant.key] = made
                self._save()
        if made:
            MIG_CREATE_SECONDS.labels(node=self._node).observe(time.monotonic() - started)
            await self._on_change()  # ListAndWatch and the inventory show the new geometry
        return with_mig_devices(grant, {m.gpu_uuid: m.mig_uuid for m in made})

    async def _create_all(self, grant: ContainerGrant) -> list[MigInstance]:
        dynamic = {gpu.uuid for gpu in self._gpus() if gpu.mig_dynamic}
        made: list[MigInstance] = []
        try:
            for gpu_uuid in grant.gpu_uuids:
                if gpu_uuid in dynamic:
                    made.append(await self._create(grant.key, gpu_uuid))
        except BaseException:
            for instance in made:  # all or nothing: a half-served container holds nothing
                await asyncio.to_thread(self._destroy, instance)
            raise
        return made

    async def _create(self, key: str, gpu_uuid: str) -> MigInstance:
        request = MigPrepareRequest(node=self._node, gpu_uuid=gpu_uuid, key=key)
        try:
            reply = await self._bus.request(
                subjects.ALLOC_MIG, request, MigPrepareReply, timeout=self._timeout_s
            )
        except BusError as exc:  # the allocator's refusal too
            log.error(
                "no MIG placement from the allocator",
                extra={"node": self._node, "gpu": gpu_uuid, "key": key, "reason": str(exc)},
            )
            raise DynamicMigError(f"no MIG placement for GPU {gpu_uuid}: {exc}") from exc
        fields = {
            "node": self._node,
            "gpu": gpu_uuid,
            "pod": f"{reply.namespace}/{reply.pod}",
            "container": reply.container,
            "profile": reply.profile,
            "start": reply.start,
        }
        try:
            instance = await asyncio.to_thread(self._make, gpu_uuid, reply)
        except ValueError as exc:
            MIG_INSTANCES.labels(self._node, reply.profile, "failed").inc()
            log.error("cannot create a MIG instance", extra={**fields, "reason": str(exc)})
            raise DynamicMigError(
                f"cannot create a {reply.profile} MIG instance at slice {reply.start} of GPU "
                f"{gpu_uuid}: {exc}"
            ) from exc
        MIG_INSTANCES.labels(self._node, reply.profile, "created").inc()
        log.info("MIG instance created", extra={**fields, "mig_device": instance.mig_uuid})
        return instance

    def _make(self, gpu_uuid: str, reply: MigPrepareReply) -> MigInstance:
        gi_id = self._backend.create_gpu_instance(gpu_uuid, reply.profile, reply.start)
        try:
            ci_id = self._backend.create_compute_instance(gpu_uuid, gi_id)
        except ValueError:
            self._backend.destroy_gpu_instance(gpu_uuid, gi_id)
            raise
        device = next(
            d for d in self._backend.mig_devices(gpu_uuid) if (d.gi_id, d.ci_id) == (gi_id, ci_id)
        )
        return MigInstance(
            gpu_uuid=gpu_uuid,
            gi_id=gi_id,
            ci_id=ci_id,
            mig_uuid=device.uuid,
            profile=reply.profile,
            pod_uid=reply.pod_uid,
            pod=f"{reply.namespace}/{reply.pod}",
        )

    def _destroy(self, instance: MigInstance) -> bool:
        fields = {
            "node": self._node,
            "gpu": instance.gpu_uuid,
            "pod": instance.pod,
            "mig_device": instance.mig_uuid,
        }
        try:
            self._backend.destroy_compute_instance(
                instance.gpu_uuid, instance.gi_id, instance.ci_id
            )
        except ValueError as exc:
            if getattr(exc, "code", "") != "not_found":
                log.warning("MIG instance not destroyed yet", extra={**fields, "reason": str(exc)})
                return False
        try:
            self._backend.destroy_gpu_instance(instance.gpu_uuid, instance.gi_id)
        except ValueError as exc:
            if getattr(exc, "code", "") != "not_found":
                log.warning("MIG instance not destroyed yet", extra={**fields, "reason": str(exc)})
                return False
        MIG_INSTANCES.labels(self._node, instance.profile, "destroyed").inc()
        log.info("MIG instance destroyed", extra=fields)
        return True

    async def release_key(self, key: str) -> None:
        """The container of directory `key` is gone: destroy what was made for it."""
        await self._release(lambda k, _: k == key)

    async def release_pod(self, pod_uid: str) -> None:
        """The allocator released pod `pod_uid`: destroy every instance made for it."""
        await self._release(lambda _, instance: instance.pod_uid == pod_uid)

    async def _release(self, gone: Callable[[str, MigInstance], bool]) -> None:
        changed = False
        async with self._lock:
            for key, made in list(self._instances.items()):
                doomed = [m for m in made if gone(key, m)]
                if not doomed:
                    continue
                kept = [m for m in made if m not in doomed]
                for instance in doomed:
                    if await asyncio.to_thread(self._destroy, instance):
                        changed = True
                    else:
                        kept.append(instance)
                if kept:
                    self._instances[key] = kept
                else:
                    del self._instances[key]
                self._save()
        if changed:
            await self._on_change()


def enable_mig_mode(backend: MigControl, gpus: list[GpuDevice]) -> list[str]:
    """MIG mode on for every dynamic-MIG GPU still in whole-GPU mode; their UUIDs. (On a real
    GPU the driver resets it to apply the mode when it can; where it cannot, processes on it
    or a VM, the mode waits for a reset the operator does, as for static MIG: hold_pending.)"""
    enabled = []
    for gpu in gpus:
        if gpu.mig_dynamic and not gpu.mig_mode:
            backend.set_mig_mode(gpu.uuid, True)
            enabled.append(gpu.uuid)
    return enabled


def hold_pending(gpus: list[GpuDevice]) -> list[GpuDevice]:
    """Dynamic-MIG GPUs whose MIG mode is not on yet (a GPU reset pending) shown unhealthy,
    so nothing is placed on or allocated from them until the mode takes effect."""
    return [
        msgspec.structs.replace(gpu, healthy=False)
        if gpu.mig_dynamic and not gpu.mig_mode and gpu.healthy
        else gpu
        for gpu in gpus
    ]


def with_mig_devices(grant: ContainerGrant, mig_of: dict[str, str]) -> ContainerGrant:
    """The grant naming MIG devices where `mig_of` maps a GPU to one (env and CDI names)."""
    if not mig_of:
        return grant

    def swap(text: str) -> str:
        for gpu_uuid, mig_uuid in mig_of.items():
            text = text.replace(gpu_uuid, mig_uuid)
        return text

    envs = {k: swap(v) if k == VISIBLE_DEVICES_ENV else v for k, v in grant.envs.items()}
    annotations = {
        k: swap(v) if k.startswith(CDI_ANNOTATION_PREFIX) else v
        for k, v in grant.annotations.items()
    }
    # volume-mounts names each device by a mount under /var/run/nvidia-container-devices.
    mounts = tuple(
        dataclasses.replace(m, container_path=swap(m.container_path)) for m in grant.mounts
    )
    return dataclasses.replace(
        grant,
        envs=envs,
        annotations=annotations,
        mounts=mounts,
        cdi_devices=tuple(swap(name) for name in grant.cdi_devices),
    )
