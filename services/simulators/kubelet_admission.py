"""Pod admission as the kubelet's device manager does it.

Containers are admitted in order (init containers first). Each container that asks for a
device-plugin resource gets devices chosen from healthy, unallocated IDs - the devices of
finished init containers of the same pod first - with the plugin's GetPreferredAllocation as
a hint, then one Allocate call carrying one container request and no pod identity. Devices
are recorded only when the whole pod is admitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import grpc

from services.common.kubelet import deviceplugin_v1beta1_pb2 as pb
from services.common.tracing import current_traceparent
from services.simulators.kubelet_devices import DeviceRegistry, Metadata, PluginEndpoint
from services.simulators.kubelet_pods import ContainerSpec, PodSpec
from services.simulators.kubelet_records import (
    AdmitResult,
    AdmittedContainer,
    ContainerRecord,
    DeviceSpecInfo,
    MountInfo,
    PodRecord,
    PodRecords,
)

log = logging.getLogger("vgpu.kubeletsim")

# (pod uid, container, resource, device ID -> NUMA nodes, the plugin's response), called right
# after each Allocate as the kubelet writes its checkpoint; OSError fails the admission.
AllocatedHook = Callable[[str, str, str, dict[str, list[int]], pb.ContainerAllocateResponse], None]


class AdmissionFailure(Exception):
    pass


def _metadata() -> Metadata:
    traceparent = current_traceparent()
    return (("traceparent", traceparent),) if traceparent else ()


def _rpc_error(exc: grpc.aio.AioRpcError) -> str:
    return f"rpc error: code = {exc.code().name} desc = {exc.details()}"


def _add_response(admitted: AdmittedContainer, response: pb.ContainerAllocateResponse) -> None:
    admitted.envs.update(response.envs)
    admitted.annotations.update(response.annotations)
    admitted.mounts.extend(
        MountInfo(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
        for m in response.mounts
    )
    admitted.devices.extend(
        DeviceSpecInfo(
            container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
        )
        for d in response.devices
    )
    admitted.cdi_devices.extend(d.name for d in response.cdi_devices)


class Admitter:
    def __init__(
        self,
        node_name: str,
        registry: DeviceRegistry,
        records: PodRecords,
        device_resources: Iterable[str],
        on_allocated: AllocatedHook | None = None,
    ) -> None:
        self._node = node_name
        self._on_allocated = on_allocated
        self._registry = registry
        self._records = records
        self._advertised = set(device_resources)

    def _is_device_resource(self, resource: str) -> bool:
        # Extended resources no plugin ever advertised are ignored, as the kubelet does;
        # that is what lets parameter resources (nvidia.com/gpumem) ride on a pod.
        return resource in self._advertised or self._registry.endpoint(resource) is not None

    async def admit(self, pod: PodSpec) -> AdmitResult:
        """Callers serialise admissions (the kubelet admits one pod at a time)."""
        if self._records.get(pod.namespace, pod.name) is not None:
            return AdmitResult(
                namespace=pod.namespace,
                name=pod.name,
                uid=pod.uid,
                error=f"pod {pod.namespace}/{pod.name} is already admitted on node {self._node}",
            )
        reusable: dict[str, list[str]] = {}
        held: dict[str, set[str]] = {}  # this pod's devices so far, per resource
        records: list[ContainerRecord] = []
        admitted: list[AdmittedContainer] = []
        try:
            for container in pod.containers:
                record, answer = await self._admit_container(pod, container, reusable, held)
                records.append(record)
                admitted.append(answer)
        except AdmissionFailure as exc:
            message = f"UnexpectedAdmissionError: Allocate failed due to {exc}, which is unexpected"
            log.warning(
                "pod failed admission",
                extra={"pod": f"{pod.namespace}/{pod.name}", "error": message},
            )
            return AdmitResult(namespace=pod.namespace, name=pod.name, uid=pod.uid, error=message)
        result = AdmitResult(
            namespace=pod.namespace, name=pod.name, uid=pod.uid, containers=admitted
        )
        self._records.add(PodRecord(pod.namespace, pod.name, pod.uid, records, result))
        return result

    async def _admit_container(
        self,
        pod: PodSpec,
        container: ContainerSpec,
        reusable: dict[str, list[str]],
        held: dict[str, set[str]],
    ) -> tuple[ContainerRecord, AdmittedContainer]:
        record = ContainerRecord(container.name, container.init, container.restartable)
        answer = AdmittedContainer(
            name=container.name, init=container.init, container_env=dict(container.env)
        )
        for resource, needed in container.extended.items():
            if needed == 0 or not self._is_device_resource(resource):
                continue
            endpoint = self._registry.endpoint(resource)
            if endpoint is None or not endpoint.connected:
                raise AdmissionFailure(f"no device plugin serves {resource} on node {self._node}")
            in_use = self._records.in_use(resource) | held.get(resource, set())
            device_ids = await self._choose(endpoint, needed, reusable.get(resource, []), in_use)
            try:
                response = await endpoint.allocate(device_ids, _metadata())
            except grpc.aio.AioRpcError as exc:
                raise AdmissionFailure(_rpc_error(exc)) from exc
            if not response.container_responses:
                raise AdmissionFailure(f"no containers return in allocation response {response}")
            record.devices[resource] = {d: endpoint.numa_nodes(d) for d in device_ids}
            if self._on_allocated is not None:
                try:
                    self._on_allocated(
                        pod.uid,
                        container.name,
                        resource,
                        record.devices[resource],
                        response.container_responses[0],
                    )
                except OSError as exc:
                    raise AdmissionFailure(f"failed to write checkpoint file: {exc}") from exc
            held.setdefault(resource, set()).update(device_ids)
            answer.device_ids.extend(device_ids)
            _add_response(answer, response.container_responses[0])
            # A finished init container's devices go back to the pod's pool; app containers
            # and sidecars keep theirs.
            pool = reusable.get(resource, [])
            if container.init and not container.restartable:
                reusable[resource] = list(dict.fromkeys([*pool, *device_ids]))
            else:
                reusable[resource] = [d for d in pool if d not in device_ids]
        return record, answer

    async def _choose(
        self, endpoint: PluginEndpoint, needed: int, reusable: list[str], in_use: set[str]
    ) -> list[str]:
        chosen = reusable[:needed]
        remaining = needed - len(chosen)
        if remaining == 0:
            return chosen
        available = [d for d in endpoint.healthy_ids() if d not in in_use]
        if len(available) < remaining:
            raise AdmissionFailure(
                f"requested number of devices unavailable for {endpoint.resource}. "
                f"Requested: {remaining}, Available: {len(available)}"
            )
        if endpoint.options.get_preferred_allocation_available:
            offered = [*chosen, *available]
            try:
                hint = await endpoint.preferred(offered, chosen, needed, _metadata())
            except grpc.aio.AioRpcError as exc:
                raise AdmissionFailure(
                    f"device plugin GetPreferredAllocation rpc failed with err: {_rpc_error(exc)}"
                ) from exc
            if len(set(hint)) == needed == len(hint) and set(chosen) <= set(hint) <= set(offered):
                return hint
            log.warning(
                "ignoring an invalid preferred allocation",
                extra={"resource": endpoint.resource, "hint": hint, "needed": needed},
            )
        return [*chosen, *available[:remaining]]
