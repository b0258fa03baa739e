"""The node agent: device plugin for the kubelet, GPU inventory and usage for NATS, node
labels, XID health, the hooks' relay, and cleanup of per-container directories."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path

import grpc

from services.common import subjects
from services.common.bus import Bus
from services.common.logs import add_context_fields, log_fields
from services.common.schemas import AllocationEvent, GpuDevice, GpuUsage
from services.common.tasks import stop_task
from services.common.tracing import setup_tracing
from services.common.vitals import Vitals
from services.nodeagent import limits_file
from services.nodeagent.address import node_address
from services.nodeagent.catalog import DeviceCatalog
from services.nodeagent.cleanup import DirectoryJanitor
from services.nodeagent.container_files import config_dir
from services.nodeagent.containers import ContainerRecords, ResolvedContainer
from services.nodeagent.context_overhead import container_overhead, parse_overheads
from services.nodeagent.device_watch import DeviceWatcher
from services.nodeagent.dynamic_mig import DynamicMig, enable_mig_mode, hold_pending
from services.nodeagent.gpus import GpuBackend, GpuProcess, NvmlInitError, backend_for
from services.nodeagent.gpus.backend import LoadSink, MigControl
from services.nodeagent.gpus.none import NoGpuBackend
from services.nodeagent.grant import (
    ContainerGrant,
    GrantIssuer,
    GrantOptions,
    MpsShare,
    container_key,
    parse_strategies,
    plan_grant,
)
from services.nodeagent.health import HealthMarks, HealthMonitor, parse_xids
from services.nodeagent.kubelet_checkpoint import CHECKPOINT_FILE, KubeletCheckpoint
from services.nodeagent.labels import REPLICAS, SHARING, NodeLabeler, gpu_labels, labeler_for
from services.nodeagent.mig_plugin import MIG_OPTIONS, MigDevicePluginServicer, mig_socket_name
from services.nodeagent.mig_resources import (
    MigEntry,
    MigStrategyError,
    mark_dynamic,
    mig_labels,
    mig_renames,
    mig_resources,
    parse_dynamic,
    slice_served,
)
from services.nodeagent.mode_labels import MODE_LABEL, with_label_modes
from services.nodeagent.modes import EXCLUSIVE, MPS, TIME_SLICING, VGPU
from services.nodeagent.mps import MpsDaemons
from services.nodeagent.plugin import OPTIONS, DevicePluginServicer
from services.nodeagent.podresources import PodResourcesClient
from services.nodeagent.preferred import PreferenceAdvisor
from services.nodeagent.process_map import ProcessAttributor, figures_of
from services.nodeagent.publisher import GpuSharing, HostCapacity, Publisher
from services.nodeagent.registration import DevicePluginServer
from services.nodeagent.relay import RelayHub
from services.nodeagent.resolver import AllocateCall, AllocationResolver
from services.nodeagent.resource_config import parse_resource_config
from services.nodeagent.settings import (
    NodeAgentSettings,
    advertised_resource,
    check_settings,
    hook_settings,
    host_capacity,
    mode_plan,
    node_mode,
    with_mig_rules,
)
from services.nodeagent.verify import ComputeCheck, Verifier

log = logging.getLogger("vgpu.nodeagent")
add_context_fields(log)  # every line of an agent names its node (log_fields in start/stop)


def agent_version() -> str:
    try:
        return metadata.version("vgpu")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


class NodeAgent:
    """Serves one node. Keeps no placement state: only which GPU each device ID names, and
    whose each per-container directory is."""

    def __init__(
        self,
        settings: NodeAgentSettings,
        gpu_backend: GpuBackend | None = None,
        labeler: NodeLabeler | None = None,
    ) -> None:
        check_settings(settings)
        subjects.node_token(settings.node_name)  # the name must fit in a NATS subject
        rules = parse_resource_config(settings.resource_config) if settings.resource_config else []
        # The fork's MIG rules rename mixed-strategy resources (mig_resources.py).
        self._mig_renames = mig_renames(rules)
        if self._mig_renames and settings.mig_strategy == "none":
            settings = with_mig_rules(settings)
            log.info(
                "resource_config MIG rules: MIG devices advertised per profile (mixed)",
                extra={"node": settings.node_name, "rules": [r.source for r in rules if r.is_mig]},
            )
        self._settings = settings
        # What the kubelet sees: NVIDIA's rename / the fork's resource_config, else ours.
        self.resource_name = advertised_resource(settings)
        self._mps: MpsDaemons | None = None
        # Simulated GPUs are made now so a bad spec fails at once; NVML starts in start().
        if gpu_backend is None and settings.simulate:
            gpu_backend = backend_for(
                settings.node_name,
                settings.simulate,
                simulate_driver_dir=settings.simulate_driver_dir,
                simulate_mig=settings.simulate_mig,
            )
        self._backend = gpu_backend
        self._labeler = (
            labeler
            if labeler is not None
            else labeler_for(settings.node_labeler, settings.node_name)
        )
        self._stack = contextlib.AsyncExitStack()
        # Its loops (heartbeats, device plugins, device watch, janitor): one ending unasked
        # is a crash that whoever runs it in-process (`vgpu up`) restarts it for.
        self.vitals = Vitals(f"node agent {settings.node_name}")
        self._plugin_server: DevicePluginServer | None = None
        self._plugin_servers: list[DevicePluginServer] = []  # the MIG resources' too
        self._catalog: DeviceCatalog | None = None
        self._watcher: DeviceWatcher | None = None
        self._relay: RelayHub | None = None
        self._janitor: DirectoryJanitor | None = None
        self._verifier: Verifier | None = None
        # Why the agent serves no GPU (no NVML, no GPU), when fail_on_init_error=false let it
        # stay up anyway: registered with the kubelet and on the bus, with nothing to offer.
        self.idle_reason = ""

    @property
    def node_name(self) -> str:
        return self._settings.node_name

    @property
    def socket_path(self) -> Path:
        return Path(self._settings.plugin_dir) / self._settings.socket_name

    @property
    def gpu_backend(self) -> GpuBackend:
        if self._backend is None:
            raise RuntimeError("the node agent has no GPU backend (not started, or idle)")
        return self._backend

    @property
    def labeler(self) -> NodeLabeler | None:
        return self._labeler

    @property
    def relay(self) -> RelayHub:
        if self._relay is None:
            raise RuntimeError("node agent is not started")
        return self._relay

    @property
    def verifier(self) -> Verifier:
        if self._verifier is None:
            raise RuntimeError("node agent is not started")
        return self._verifier

    @property
    def janitor(self) -> DirectoryJanitor:
        if self._janitor is None:
            raise RuntimeError("node agent is not started")
        return self._janitor

    @property
    def gpus(self) -> list[GpuDevice]:
        if self._catalog is not None:
            return self._catalog.gpus
        return self._backend.devices() if self._backend is not None else []

    async def start(self) -> None:
        if self._plugin_server is not None:
            return
        # The agent's tasks, threads and gRPC handlers start here and inherit the field.
        with log_fields(node=self._settings.node_name):
            try:
                await self._start()
            except BaseException:
                await self.stop()
                raise

    def _open_backend(self) -> GpuBackend:
        s = self._settings
        if self._backend is not None:
            return self._backend
        try:
            self._backend = backend_for(
                s.node_name, s.simulate, s.sysfs_root, s.simulate_driver_dir, s.simulate_mig
            )
        except NvmlInitError as exc:
            if s.fail_on_init_error:
                raise NvmlInitError(
                    f"{exc} (set fail_on_init_error=false to idle on nodes without GPUs)"
                ) from exc
            self.idle_reason = f"NVML unavailable: {exc}"
            self._backend = NoGpuBackend(self.idle_reason)
        return self._backend

    async def _start(self) -> None:
        s = self._settings
        setup_tracing("vgpu-nodeagent", s.otlp_endpoint)
        if s.mode_labels and self._labeler is not None:
            s = self._settings = await self._modes_from_node(s)
        backend = await asyncio.to_thread(self._open_backend)
        self._stack.callback(backend.close)
        marks = HealthMarks()
        dynamic = parse_dynamic(s.mig_dynamic)

        def view(gpus: list[GpuDevice]) -> list[GpuDevice]:
            marked = marks.apply(gpus)
            return hold_pending(mark_dynamic(marked, dynamic)) if s.mig_dynamic else marked

        if s.mig_dynamic:
            if not isinstance(backend, MigControl):
                raise ValueError(
                    "mig_dynamic needs a GPU backend that creates MIG instances; this one "
                    f"({type(backend).__name__}) does not"
                )
            enabled = await asyncio.to_thread(
                lambda: enable_mig_mode(backend, mark_dynamic(backend.devices(), dynamic))
            )
            if enabled:
                log.info(
                    "MIG mode enabled for dynamic MIG",
                    extra={"node": s.node_name, "gpus": enabled},
                )
            for gpu in await asyncio.to_thread(lambda: view(backend.devices())):
                if gpu.mig_dynamic and not gpu.mig_mode:
                    log.warning(
                        "dynamic MIG GPU waits for a GPU reset to turn MIG mode on; it is "
                        "advertised unhealthy until then",
                        extra={"node": s.node_name, "gpu": gpu.uuid, "reason": "reset pending"},
                    )
        first = await asyncio.to_thread(lambda: view(backend.devices()))
        if not first and not self.idle_reason:
            # As 4paradigm's plugin: no GPU is an init error (exit, so the DaemonSet's pod
            # shows it), unless the operator runs the agent on nodes without GPUs too.
            if s.fail_on_init_error:
                raise NvmlInitError(
                    "no GPUs found (set fail_on_init_error=false to idle on nodes without GPUs)"
                )
            self.idle_reason = "no GPUs found"
        if self.idle_reason:
            # Registered with nothing: the kubelet sees zero devices, the allocator a node
            # without GPUs; GPUs that appear later are picked up by the device watcher.
            log.warning("node agent idle", extra={"node": s.node_name, "reason": self.idle_reason})
        strategy = s.mig_strategy
        # Refuses bad geometry (single) and a MIG rule onto a resource the node already serves.
        mig_names = list(mig_resources(first, strategy, s.resource_name, self._mig_renames))
        stack = self._stack
        bus = await Bus.connect(s.nats_url, f"vgpu-nodeagent-{s.node_name}")
        stack.push_async_callback(bus.close)
        locator = PodResourcesClient(s.pod_resources_socket)
        stack.push_async_callback(locator.close)
        if strategy != "single" and self.resource_name in mig_names:
            whole = [gpu.index for gpu in first if slice_served(gpu, strategy)]
            if whole:  # two device plugins cannot both register one resource
                raise MigStrategyError(
                    f"resource_config turns MIG devices into {self.resource_name}, which this "
                    f"node already advertises for GPU(s) {whole} (MIG off, or dynamic MIG): "
                    "put them in MIG mode or give the MIG rule another TO"
                )
        catalog = DeviceCatalog(
            first, s.split_count, mode_plan(s), lambda gpu: slice_served(gpu, strategy)
        )
        self._catalog = catalog
        mps_gpus = [gpu for gpu in catalog.gpus if gpu.sharing_mode == MPS]
        if mps_gpus:
            mps = MpsDaemons(
                node_name=s.node_name,
                command=s.mps_control,
                mps_root=s.mps_root,
                gpus=mps_gpus,
                interval_s=s.mps_watch_interval_s,
            )
            stack.push_async_callback(mps.stop)
            await mps.start()
            self._mps = mps

        attributor = ProcessAttributor(Path(s.proc_root))
        relay = RelayHub(
            node_name=s.node_name,
            bus=bus,
            host_index={gpu.uuid: gpu.index for gpu in first},
            attributor=attributor,
            publish_interval_s=s.relay_publish_interval_s,
            util_interval_s=s.util_interval_s,
            device_memory_mib={gpu.uuid: gpu.memory_mib for gpu in first},
            max_connections=s.relay_max_connections,
        )
        self._relay = relay
        stack.push_async_callback(relay.stop)
        verifier = Verifier(
            node_name=s.node_name,
            bus=bus,
            on_violation=s.on_violation,
            tolerance_percent=s.violation_tolerance_percent,
            tolerance_mib=s.violation_tolerance_mib,
            confirm_s=s.violation_confirm_s,
            compute=ComputeCheck(
                policy=s.compute_policy,
                tolerance_percent=s.violation_compute_tolerance_percent,
                confirm_s=s.violation_compute_confirm_s,
            ),
            # hooks report every 250 ms; a figure older than a few samples says nothing
            report_fresh_s=max(2.0, 4 * s.usage_interval_s),
            proc_root=Path(s.proc_root),
        )
        self._verifier = verifier
        stack.callback(verifier.forget_all)
        # Simulated GPUs make up load: tell them what runs where (real GPUs measure it).
        load = backend if isinstance(backend, LoadSink) else None

        async def container_started(container: ResolvedContainer) -> None:
            await relay.open(container)
            if load is not None:
                self._attach_load(load, container)

        records = ContainerRecords(Path(s.state_dir))

        dynamic_mig: DynamicMig | None = None
        if s.mig_dynamic and isinstance(backend, MigControl):
            dynamic_mig = DynamicMig(
                node_name=s.node_name,
                backend=backend,
                bus=bus,
                gpus=lambda: catalog.gpus,
                on_change=self.refresh_devices,
                state_dir=Path(s.state_dir),
            )
            await asyncio.to_thread(dynamic_mig.restore)

            async def pod_released(event: AllocationEvent) -> None:
                if event.kind == "released" and dynamic_mig is not None:
                    await dynamic_mig.release_pod(event.allocation.uid)

            await bus.subscribe(subjects.alloc_events(s.node_name), AllocationEvent, pod_released)

        async def container_gone(key: str) -> None:
            if dynamic_mig is not None:
                await dynamic_mig.release_key(key)
            await relay.close(key)
            verifier.forget(key)
            records.drop(key)
            if load is not None:
                load.detach(key)

        for restored in records.load():
            # An agent restart keeps serving running containers, from its own records only.
            await self._restore(restored, records, container_started)
        await relay.start()

        async def on_sample(gpus: list[GpuUsage], processes: list[GpuProcess]) -> None:
            assigned = attributor.assign(processes, relay.peers(), relay.containers)
            relay.observe(gpus, figures_of(assigned))
            await verifier.check(
                relay.containers, assigned, relay.claims, {g.uuid: g.sm_util_percent for g in gpus}
            )
            for container in relay.containers:
                relay.set_flags(container.key, verifier.flags(container.key))

        publisher = Publisher(
            sharing=GpuSharing(s.memory_scaling, s.cores_scaling, s.split_count),
            bus=bus,
            node_name=s.node_name,
            backend=backend,
            catalog=catalog,
            heartbeat_s=s.heartbeat_s,
            usage_interval_s=s.usage_interval_s,
            agent_version=agent_version(),
            on_sample=on_sample,
            host=HostCapacity(*host_capacity(s)),
            address=node_address(s.node_ip, s.nats_url),
        )
        await publisher.start()
        stack.push_async_callback(publisher.stop)
        self.vitals.watch_all("the heartbeat loop", publisher.tasks)
        await self._label(catalog.gpus)

        async def resend() -> None:
            # Whatever was published while the bus was down is lost: say it all again now
            # rather than at the next heartbeat or change.
            await publisher.publish_inventory()
            await publisher.publish_usage()
            relay.resend_all()

        bus.on_reconnect(resend)

        async def on_change() -> None:
            await publisher.publish_inventory()
            await self._label(catalog.gpus)

        watcher = DeviceWatcher(backend, catalog, on_change, s.usage_interval_s, marks, view,
                                node_name=s.node_name)  # fmt: skip
        self._watcher = watcher
        watcher.start()
        stack.push_async_callback(watcher.stop)
        self.vitals.watch_all("the device watch", watcher.tasks)
        if s.health_checks and not isinstance(backend, NoGpuBackend):
            monitor = HealthMonitor(
                node_name=s.node_name,
                backend=backend,
                marks=marks,
                ignored_xids=parse_xids(s.ignored_xids),
                on_change=watcher.refresh,
            )
            monitor.start()
            stack.push_async_callback(monitor.stop)

        resolver = AllocationResolver(
            node_name=s.node_name,
            resource_name=self.resource_name,
            bus=bus,
            locator=locator,
            resolve_timeout_s=s.resolve_timeout_s,
            on_resolved=container_started,
            context_overhead=self._context_overhead(catalog),
            # Oversubscribed memory: what the card cannot hold spills to host memory.
            spill_limit_mib=s.spill_limit_mib if s.memory_scaling > 1 else None,
            checkpoint=KubeletCheckpoint(Path(s.plugin_dir) / CHECKPOINT_FILE),
            record=records.save,
        )
        stack.push_async_callback(resolver.stop)
        recovery = asyncio.create_task(
            self._recover_unrecorded(locator, resolver, catalog, {c.key for c in relay.containers}),
            name=f"recover-{s.node_name}",
        )

        async def stop_recovery() -> None:
            await stop_task(
                recovery, "recovery of unrecorded containers", fields={"node": s.node_name}
            )

        stack.push_async_callback(stop_recovery)
        janitor = DirectoryJanitor(
            node_name=s.node_name,
            container_root=Path(s.container_root),
            resource_name=self.resource_name,
            locator=locator,
            on_remove=container_gone,
            grace_s=s.container_dir_grace_s,
            interval_s=s.cleanup_interval_s,
        )
        self._janitor = janitor
        janitor.start()
        stack.push_async_callback(janitor.stop)
        self.vitals.watch_all("the container janitor", janitor.tasks)
        advisor = PreferenceAdvisor(bus, s.node_name, catalog.gpu_of)
        servicer = DevicePluginServicer(
            node_name=s.node_name,
            catalog=catalog,
            advisor=advisor,
            issuer=GrantIssuer(
                catalog,
                Path(s.container_root),
                Path(s.hook_library),
                hook_settings=hook_settings(s),
                options=self._grant_options(),
                mps_share=lambda ids: self._mps_share(catalog, advisor, ids),
            ),
            resolver=resolver,
            # The allocator books only resource_name; a renamed resource is kube-scheduler's.
            resolve_unhooked=self.resource_name == s.resource_name,
            dynamic_mig=dynamic_mig,
        )
        plugin_server = DevicePluginServer(
            servicer,
            plugin_dir=s.plugin_dir,
            socket_name=s.socket_name,
            resource_name=self.resource_name,
            options=OPTIONS,
            node_name=s.node_name,
            watch_interval_s=s.kubelet_watch_interval_s,
        )
        # Under single, or when the fork's `mig-<profile>:gpu:1` makes MIG devices plain GPUs,
        # the MIG plugin serves the main resource in place of vgpu's own.
        main_by_mig = strategy == "single" or self.resource_name in mig_names
        servers = [] if main_by_mig else [plugin_server]
        for resource in mig_names:
            servers.append(self._mig_server(resource, catalog))
        for server in servers:
            stack.push_async_callback(server.stop)
        stack.push_async_callback(catalog.close)  # runs first on stop: ends ListAndWatch streams
        for server in servers:
            await server.start()
            self.vitals.watch_all(f"the {server.resource_name} device plugin", server.tasks)
        self._plugin_servers = servers
        self._plugin_server = servers[0]
        log.info(
            "node agent started",
            extra={
                "node": s.node_name,
                "gpus": len(catalog.gpus),
                "devices": len(catalog.devices()),
                "resource": self.resource_name,
                "modes": sorted({gpu.sharing_mode for gpu in catalog.gpus}),
                "mig_strategy": strategy,
                "mig_resources": mig_names,
                "socket": str(self.socket_path),
                "driver": backend.driver_version(),
                "cuda": backend.cuda_version(),
            },
        )

    async def _modes_from_node(self, s: NodeAgentSettings) -> NodeAgentSettings:
        """The settings with the sharing modes the Node's labels choose (mode_labels.py);
        RuntimeError naming the node, label and reason when they cannot be read or used."""
        assert self._labeler is not None
        try:
            labels = await self._labeler.read()
        except Exception as exc:
            raise RuntimeError(
                f"node {s.node_name}: cannot read its labels for {MODE_LABEL}: {exc} (set "
                "mode_labels=false to choose sharing modes by settings only)"
            ) from exc
        try:
            chosen = with_label_modes(s, labels)
            check_settings(chosen)
        except ValueError as exc:
            raise RuntimeError(f"node {s.node_name}: its {MODE_LABEL} labels: {exc}") from exc
        if chosen is not s:
            log.info(
                "sharing modes from node labels",
                extra={
                    "node": s.node_name,
                    "mode": chosen.sharing_mode,
                    "gpu_modes": chosen.gpu_sharing_modes,
                    "reason": f"node label {MODE_LABEL}",
                },
            )
        return chosen

    def _mig_server(self, resource: str, catalog: DeviceCatalog) -> DevicePluginServer:
        """A device plugin for one static MIG resource (its own socket, as NVIDIA's)."""
        s = self._settings

        def entries(gpus: list[GpuDevice]) -> list[MigEntry]:
            try:
                found = mig_resources(gpus, s.mig_strategy, s.resource_name, self._mig_renames)
                return found.get(resource, [])
            except MigStrategyError as exc:  # geometry changed under a running agent
                log.error(
                    "MIG geometry breaks the strategy; advertising it anyway",
                    extra={"node": s.node_name, "resource": resource, "reason": str(exc)},
                )
                return [MigEntry(m, gpu) for gpu in gpus for m in gpu.mig_devices]

        servicer = MigDevicePluginServicer(
            node_name=s.node_name,
            resource=resource,
            catalog=catalog,
            entries=entries,
            device_list_strategy=s.device_list_strategy,
            cdi_kind=s.cdi_kind,
        )
        return DevicePluginServer(
            servicer,
            plugin_dir=s.plugin_dir,
            socket_name=s.socket_name
            if resource == self.resource_name
            else mig_socket_name(resource),
            resource_name=resource,
            options=MIG_OPTIONS,
            node_name=s.node_name,
            watch_interval_s=s.kubelet_watch_interval_s,
        )

    async def _restore(
        self,
        container: ResolvedContainer,
        records: ContainerRecords,
        started: Callable[[ResolvedContainer], Awaitable[None]],
    ) -> None:
        """Serve a recorded container again: its relay socket, and its limit file as the
        agent wrote it (whatever the container did to it meanwhile). The janitor later
        removes what the kubelet no longer holds."""
        fields = {"node": self.node_name, "key": container.key, "container": container.name}
        if not container.host_dir.is_dir():
            log.info("recorded container directory is gone", extra=fields)
            records.drop(container.key)
            return
        try:
            await started(container)
            limits_file.write(config_dir(container.host_dir), container.limits)
        except OSError as exc:
            log.error("cannot restore a container", extra={**fields, "error": str(exc)})
            return
        log.info("container restored from the agent's records", extra=fields)

    async def _recover_unrecorded(
        self,
        locator: PodResourcesClient,
        resolver: AllocationResolver,
        catalog: DeviceCatalog,
        recorded: set[str],
    ) -> None:
        """Directories of running containers the agent has no record of (its state was lost,
        or an agent older than its records resolved them): ask the kubelet which containers
        hold which device IDs and resolve those again, as after an Allocate (PodResources,
        then the allocator's claim, which is idempotent). Only single-GPU containers: the
        order of several GPUs, which the limit file must follow, is not in PodResources."""
        s = self._settings
        try:
            held = await locator.held(self.resource_name)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "kubelet not answering; unrecorded container directories stay unserved",
                extra={"node": s.node_name, "error": f"{exc.code().name}: {exc.details()}"},
            )
            return
        for grant in self._unrecorded_grants(held, recorded, catalog):
            log.info(
                "resolving an unrecorded container directory again",
                extra={"node": s.node_name, "key": grant.key, "device_ids": grant.device_ids},
            )
            now = time.time_ns()
            resolver.track(AllocateCall(grant, now, now))

    def _unrecorded_grants(
        self, held: list[set[str]], recorded: set[str], catalog: DeviceCatalog
    ) -> list[ContainerGrant]:
        s = self._settings
        root = Path(s.container_root)
        hook = Path(s.hook_library) if Path(s.hook_library).is_file() else None
        grants = []
        for ids in held:
            device_ids = sorted(ids)
            key = container_key(device_ids)
            if key in recorded or not (root / key).is_dir():
                continue
            try:
                gpus = {catalog.gpu_of(device_id).uuid for device_id in device_ids}
                if len(gpus) != 1:
                    raise ValueError("the order of its GPUs is not known to the kubelet's API")
                grants.append(
                    plan_grant(catalog, device_ids, root, hook, options=self._grant_options())
                )
            except ValueError as exc:
                log.warning(
                    "unrecorded container directory not resolved again",
                    extra={"node": s.node_name, "key": key, "error": str(exc)},
                )
        return grants

    def _grant_options(self) -> GrantOptions:
        s = self._settings
        shared = node_mode(s) in (TIME_SLICING, MPS)
        return GrantOptions(
            strategies=parse_strategies(s.device_list_strategy),
            id_strategy=s.device_id_strategy,
            cdi_kind=s.cdi_kind,
            pass_device_specs=s.pass_device_specs,
            driver_root=s.nvidia_driver_root,
            max_ids_per_container=1 if shared and s.fail_requests_greater_than_one else 0,
            mps_root=s.mps_root,
        )

    @staticmethod
    def _mps_share(
        catalog: DeviceCatalog, advisor: PreferenceAdvisor, device_ids: list[str]
    ) -> MpsShare:
        """The client's share: its slice as the allocator hinted it for these IDs, else an
        equal share per replica held (what NVIDIA's MPS gives every client)."""
        gpu = catalog.gpu_of(device_ids[0])
        hinted = advisor.hinted_slices(device_ids)
        piece = next((p for p in hinted or () if p.uuid == gpu.uuid), None)
        replicas = max(1, gpu.replicas)
        held = sum(1 for d in device_ids if catalog.gpu_of(d).uuid == gpu.uuid)
        equal_memory = gpu.memory_mib * held // replicas
        equal_threads = max(1, 100 * held // replicas)
        if piece is None:
            return MpsShare(memory_mib=equal_memory, thread_percent=equal_threads)
        return MpsShare(
            memory_mib=piece.memory_mib or gpu.memory_mib,
            thread_percent=piece.cores or 100,
        )

    @property
    def mps(self) -> MpsDaemons | None:
        return self._mps

    def _attach_load(self, load: LoadSink, container: ResolvedContainer) -> None:
        load.detach(container.key)  # a new owner of the directory replaces the old one's load
        for device in container.limits.devices:
            try:
                load.attach(container.key, device.uuid, device.memory_limit_mib, device.cores)
            except ValueError as exc:  # e.g. a restored directory from another GPU spec
                log.warning(
                    "simulated load not attached",
                    extra={"node": self.node_name, "key": container.key, "error": str(exc)},
                )

    def _context_overhead(self, catalog: DeviceCatalog) -> Callable[[tuple[str, ...]], int] | None:
        rules = parse_overheads(self._settings.context_overhead)
        if not rules:
            return None
        # Read the catalog at each container: GPUs may have come and gone since start.
        return lambda uuids: container_overhead(
            rules, {gpu.uuid: gpu.model for gpu in catalog.gpus}, uuids
        )

    async def _label(self, gpus: list[GpuDevice]) -> None:
        if self._labeler is None or self._backend is None:
            return
        labels = gpu_labels(
            gpus,
            self._backend.driver_version(),
            self._backend.cuda_version(),
            self._settings.split_count,
        )
        mode = node_mode(self._settings)
        if labels and mode != VGPU:  # GFD's values: time-slicing, mps, none
            labels[SHARING] = mode if mode in (TIME_SLICING, MPS) else "none"
            labels[REPLICAS] = "1" if mode == EXCLUSIVE else str(gpus[0].replicas)
        labels.update(mig_labels(gpus, self._settings.mig_strategy))
        try:
            await self._labeler.apply(labels)
        except Exception as exc:  # labels are a convenience: never stop serving for them
            log.warning("cannot label the node", extra={"node": self.node_name, "error": str(exc)})

    async def refresh_devices(self) -> bool:
        """Re-read the GPUs now (instead of at the next poll); True if anything changed."""
        if self._watcher is None:
            return False
        return await self._watcher.refresh()

    async def wait_registered(self, timeout_s: float = 10.0) -> None:
        if self._plugin_server is None:
            raise RuntimeError("node agent is not started")
        for server in self._plugin_servers:
            await server.wait_registered(timeout_s)

    @property
    def registrations(self) -> int:
        return 0 if self._plugin_server is None else self._plugin_server.registrations

    @property
    def resources(self) -> list[str]:
        """The resources this agent registered with the kubelet."""
        return [server.resource_name for server in self._plugin_servers]

    async def wait_died(self) -> str:
        """Until one of its loops ends unasked (it crashed); what ended and how."""
        return await self.vitals.died()

    async def stop(self) -> None:
        self.vitals.stop()
        stack, self._stack = self._stack, contextlib.AsyncExitStack()
        self._plugin_server = None
        self._plugin_servers = []
        self._watcher = None
        self._relay = None
        self._janitor = None
        self._verifier = None
        self._mps = None
        with log_fields(node=self._settings.node_name):
            await stack.aclose()
