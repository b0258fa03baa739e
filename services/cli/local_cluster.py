"""The whole system in one process: what `vgpu up` runs and the end-to-end tests drive.

Every part is the real service talking over a real NATS server, real HTTP and real gRPC on
unix sockets; only the GPUs (simulated backend) and the kubelet/kube-scheduler (simulators)
stand in for what a laptop does not have.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import msgspec

from services.allocator.backend import LocalClusterBackend
from services.allocator.service import Allocator
from services.allocator.settings import AllocatorSettings
from services.cli.local_api import LocalApiServer
from services.cli.local_pki import CLIENT_NAME, LocalPki, make_local_pki
from services.cli.local_tls import self_signed
from services.cli.local_users import admin_token, ensure_users_file
from services.cli.mig_layout import mig_layout
from services.cli.state import UpGpu, UpState
from services.cli.supervisor import Backoff, supervise
from services.common.embedded_nats import EmbeddedNats
from services.metrics.service import MetricsService
from services.metrics.settings import MetricsSettings
from services.nodeagent.labels import MemoryNodeLabeler
from services.nodeagent.service import NodeAgent
from services.nodeagent.settings import NodeAgentSettings
from services.simulators.admission import MutatingAdmission, MutatingWebhook
from services.simulators.kube_users import UsersFileSource
from services.simulators.kubelet import KubeletSimSettings, KubeletSimulator

log = logging.getLogger("vgpu.up")

RESOURCE = "nvidia.com/gpu"
PODS_FILE = "local-pods.json"  # the local API server's pods, in the JetStream store directory
# The allocator's entry of deploy/k8s/base/allocator/webhook.yaml, registered with the local
# API server as a cluster registers it (tests/cli/test_local_admission.py keeps them equal).
WEBHOOK_CONFIGURATION = {
    "name": "pods.allocator.vgpu.io",
    "admissionReviewVersions": ["v1"],
    "sideEffects": "None",
    "failurePolicy": "Ignore",
    "matchPolicy": "Equivalent",
    "reinvocationPolicy": "Never",
    "timeoutSeconds": 5,
    "clientConfig": {
        "service": {"name": "vgpu-allocator", "namespace": "vgpu-system", "port": 443,
                    "path": "/mutate"},
    },
    "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
               "resources": ["pods"], "scope": "Namespaced"}],
    "namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
         "values": ["kube-system", "vgpu-system"]},
        {"key": "vgpu.io/webhook", "operator": "NotIn", "values": ["disabled"]},
    ]},
    "objectSelector": {"matchExpressions": [
        {"key": "vgpu.io/webhook", "operator": "NotIn", "values": ["disabled"]},
    ]},
}  # fmt: skip
HOOK_BUILD = Path(__file__).resolve().parents[2] / "libvgpu-hook" / "build" / "libvgpu.so"
SIMULATED_MPS_CONTROL = f"{shlex.quote(sys.executable)} -m services.simulators.mps_control"


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


@dataclass(frozen=True)
class LocalClusterSpec:
    nodes: int = 2
    simulate: str = "4xA100-40GB"
    nats_url: str = ""  # empty: start an embedded nats-server
    # The embedded server's JetStream store: kept across restarts of the server and of
    # `vgpu up` (empty: a temporary one, removed at stop). `fresh` empties it first.
    nats_store_dir: str = ""
    fresh: bool = False
    restart_backoff: Backoff = field(default_factory=Backoff)
    allocator_port: int = 8080
    # The extender's HTTPS port (client certificates of `vgpu up`'s own CA); taken: any free.
    extender_port: int = 9443
    # Where that CA's certificates go ("" = the work directory); removed at stop.
    tls_dir: str = ""
    metrics_port: int = 9400
    split_count: int = 10
    # 4paradigm's --device-memory-scaling / --device-cores-scaling for every node agent
    # (0 = not stated: the allocator's own settings apply).
    memory_scaling: float = 0.0
    cores_scaling: float = 0.0
    # How every node shares its GPUs (docs/modes.md): vgpu, time-slicing, mps or exclusive.
    mode: str = "vgpu"
    # Labels the simulated Node objects carry, per node: `vgpu.io/mode` (and
    # `vgpu.io/mode.<gpu index>`) there set that node's sharing mode over `mode`.
    node_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    heartbeat_s: float = 5.0
    # The local API server calls the allocator's mutating webhook on pod CREATE, as a cluster
    # does with deploy/k8s (off: pods reach the scheduler exactly as written).
    admission_webhook: bool = True
    hook_library: str = str(HOOK_BUILD)
    # MIG on every node (mig_layout.py): half the MIG GPUs partitioned and advertised under
    # NVIDIA's mixed names, half left to dynamic MIG.
    mig: bool = False
    # /allocations, the metrics API, the dashboard and /metrics check bearer tokens with the
    # local API server, which answers from this users file (made if missing; empty: one in
    # the work directory, gone at stop). False: those read APIs are open to any local user.
    read_auth: bool = True
    users_file: str = ""


class KubeletFollower:
    """As a kubelet watches the API server: a pod deleted there is stopped on its node (the
    simulator frees its devices)."""

    def __init__(self, kubelets: dict[str, KubeletSimulator]) -> None:
        self._kubelets = kubelets

    async def on_list(self, items: list[dict[str, Any]], listed_at: float) -> None:
        pass  # the simulators start empty; nothing to stop

    async def on_change(self, kind: str, pod: dict[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        kubelet = self._kubelets.get(node) if kind == "DELETED" and node else None
        if kubelet is not None:
            metadata = pod.get("metadata") or {}
            kubelet.remove(metadata.get("namespace") or "default", metadata.get("name") or "")


def _port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


async def _stop_quietly(service: Service) -> None:
    """Stop what is left of a dead service; a failure here must not stop its restart."""
    try:
        await service.stop()
    except Exception:
        log.exception("stopping a dead service failed", extra={"service": type(service).__name__})


def node_names(count: int) -> list[str]:
    return [f"node-{index + 1}" for index in range(count)]


def parse_node_labels(items: tuple[str, ...] | list[str], nodes: int) -> dict[str, dict[str, str]]:
    """`node-2:vgpu.io/mode=mps` items -> {"node-2": {"vgpu.io/mode": "mps"}}; ValueError
    quoting the bad item."""
    known = node_names(nodes)
    labels: dict[str, dict[str, str]] = {}
    for item in items:
        node, colon, label = item.partition(":")
        key, equals, value = label.partition("=")
        if not colon or not equals or not key:
            raise ValueError(f"{item!r}: expected NODE:KEY=VALUE, e.g. node-2:vgpu.io/mode=mps")
        if node not in known:
            raise ValueError(f"{item!r}: no node {node!r} (nodes: {', '.join(known)})")
        labels.setdefault(node, {})[key] = value
    return labels


async def _start_on_port(make: Callable[[int], Service], port: int, what: str) -> Service:
    """Start on the preferred port; if it is taken, on any free one (and say so)."""
    service = make(port)
    try:
        await service.start()
        return service
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or port == 0:
            raise
    log.warning("port in use, using a free one", extra={"service": what, "port": port})
    service = make(0)
    await service.start()
    return service


class LocalCluster:
    def __init__(self, spec: LocalClusterSpec) -> None:
        if spec.nodes < 1:
            raise ValueError(f"a local cluster needs at least one node, got {spec.nodes}")
        self._mig = mig_layout(spec.simulate) if spec.mig else None  # refuses GPUs without MIG
        self.spec = spec
        self.nats: EmbeddedNats | None = None
        self.nats_url = spec.nats_url
        self.allocator: Allocator | None = None
        self.api: LocalApiServer | None = None
        self.metrics: MetricsService | None = None
        self.kubelets: dict[str, KubeletSimulator] = {}
        self.agents: dict[str, NodeAgent] = {}
        # Unix socket paths must stay under 108 bytes: keep the root short.
        self.work_dir = Path(tempfile.mkdtemp(prefix="vgpu-", dir="/tmp"))
        self.tls_dir = Path(spec.tls_dir) if spec.tls_dir else self.work_dir / "tls"
        self.pki: LocalPki | None = None
        self._started: list[Service] = []
        self._nats_supervisor: asyncio.Task[None] | None = None
        # One per in-process service: restarts it when it dies (supervisor.py).
        self._supervisors: list[asyncio.Task[None]] = []
        self._agent_settings: dict[str, NodeAgentSettings] = {}
        self._kubelet_follower: asyncio.Task[None] | None = None
        self.users: UsersFileSource | None = None
        self._webhook_ca = ""

    async def start(self, ready_timeout_s: float = 10.0) -> None:
        try:
            await self._start(ready_timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def _start(self, ready_timeout_s: float) -> None:
        spec = self.spec
        if not self.nats_url:
            # Started from this thread on purpose: the server is tied to its parent thread's
            # life (PR_SET_PDEATHSIG), and a worker thread may come and go. It takes ~50 ms.
            store = spec.nats_store_dir or None
            if store and spec.fresh:
                shutil.rmtree(store, ignore_errors=True)
                log.warning("--fresh: the JetStream store was emptied", extra={"store": store})
            self.nats = EmbeddedNats(store_dir=store).start()
            self.nats_url = self.nats.url
            self._nats_supervisor = asyncio.create_task(
                supervise("nats-server", self.nats.wait_exit, self._restart_nats,
                          spec.restart_backoff),
                name="supervise-nats-server",
            )  # fmt: skip
        nats_url = self.nats_url

        # The pods live beside the JetStream store, so a restart keeps both, or neither
        # (--fresh): the bookings it remembers have their pods behind them.
        store = spec.nats_store_dir if not spec.nats_url else ""
        backend = LocalClusterBackend(Path(store) / PODS_FILE if store else None)
        # The extender as deploy/k8s serves it: HTTPS, only the scheduler's client certificate.
        pki = self.pki = make_local_pki(self.tls_dir)
        extender: dict[str, object] = {
            "extender_host": "127.0.0.1",
            "extender_cert_file": pki.server_cert_file,
            "extender_key_file": pki.server_key_file,
            "extender_client_ca_file": pki.ca_file,
            "extender_client_allowed": f"CN={CLIENT_NAME}",
        }
        if spec.read_auth:
            users_file = Path(spec.users_file or self.work_dir / "users.json")
            ensure_users_file(users_file)
            self.users = UsersFileSource(users_file)
        # First: the allocator and the metrics service check tokens with it.
        self.api = await self._run(lambda port: LocalApiServer(backend, users=self.users), 0,
                                   "api")  # fmt: skip
        auth = {"read_auth": "kubernetes", "auth_api_url": self.api.url} if spec.read_auth else {}
        webhook: dict[str, object] = {}
        if spec.admission_webhook:
            cert = self_signed(self.work_dir / "webhook-tls", "vgpu-allocator.vgpu-system.svc")
            webhook = {"webhook_port": 0, "webhook_host": "127.0.0.1",
                       "tls_cert_file": cert.cert_file, "tls_key_file": cert.key_file}  # fmt: skip
            webhook_ca = cert.ca_file
            self._webhook_ca = webhook_ca
        self.allocator = await self._run(
            lambda port: Allocator(
                msgspec.convert({"nats_url": nats_url, "http_port": port, **webhook, **extender,
                                 **auth, "extender_port": spec.extender_port if port else 0},
                                AllocatorSettings), backend,
            ),
            spec.allocator_port, "allocator",
        )  # fmt: skip
        if spec.admission_webhook:
            assert self.allocator is not None
            registered = MutatingWebhook.from_configuration(
                WEBHOOK_CONFIGURATION, self.allocator.webhook_url, webhook_ca
            )
            self.api.admission = MutatingAdmission([registered])
        self.metrics = await self._run(
            lambda port: MetricsService(MetricsSettings(nats_url=nats_url, http_port=port,
                                                        **auth)),
            spec.metrics_port, "metrics",
        )  # fmt: skip
        for name in node_names(spec.nodes):
            await self._start_node(name, nats_url, spec.hook_library)
        self._kubelet_follower = asyncio.create_task(
            backend.run_pod_watch(KubeletFollower(self.kubelets)), name="kubelets-follow-api"
        )
        await self._wait_ready(ready_timeout_s)
        self._supervise_services()

    def _supervise_services(self) -> None:
        """Watch every in-process service as the nats-server is watched: one that dies (a
        loop it lives by ended unasked) is stopped, made again on the same ports, sockets and
        state, and started after the backoff; said in the log and vgpu_up_restarts_total."""
        assert self.allocator is not None and self.metrics is not None
        allocator = self.allocator
        # Again on the ports it got (the state file and kube-scheduler's URL name them), as
        # the same replica (it may take its own lease back at once).
        again = msgspec.structs.replace(
            allocator.settings,
            http_port=_port_of(allocator.url),
            extender_port=(
                _port_of(allocator.extender_url) if allocator.settings.extender_port >= 0 else -1
            ),
            webhook_port=(
                _port_of(allocator.webhook_url) if allocator.settings.webhook_port >= 0 else -1
            ),
            replica_id=allocator.replica,
        )
        backend = allocator.backend
        self._watch_child(
            "allocator",
            lambda: self._live(self.allocator).wait_died(),
            lambda: self._restart_allocator(Allocator(again, backend)),
        )
        metrics_again = msgspec.structs.replace(
            self.metrics.settings, http_port=_port_of(self.metrics.url)
        )
        self._watch_child(
            "metrics",
            lambda: self._live(self.metrics).wait_died(),
            lambda: self._replace("metrics", MetricsService(metrics_again)),
        )
        for name in self.agents:
            self._watch_child(
                f"node-agent/{name}",
                lambda name=name: self.agents[name].wait_died(),  # type: ignore[misc]
                lambda name=name: self._restart_agent(name),  # type: ignore[misc]
            )
            self._watch_child(
                f"kubelet-sim/{name}",
                lambda name=name: self.kubelets[name].wait_died(),  # type: ignore[misc]
                lambda name=name: self.kubelets[name].restart(),  # type: ignore[misc]
            )

    def _watch_child(
        self,
        child: str,
        wait_died: Callable[[], Awaitable[str]],
        restart: Callable[[], Awaitable[None]],
    ) -> None:
        task = asyncio.create_task(
            supervise(child, wait_died, restart, self.spec.restart_backoff),
            name=f"supervise-{child}",
        )
        self._supervisors.append(task)

    @staticmethod
    def _live(service: Any) -> Any:
        assert service is not None
        return service

    async def _replace(self, attribute: str, new: Any) -> None:
        """Stop the dead service (what is left of it), start `new` in its place."""
        old = getattr(self, attribute)
        await _stop_quietly(old)
        await new.start()
        self._started[self._started.index(old)] = new
        setattr(self, attribute, new)

    async def _restart_allocator(self, new: Allocator) -> None:
        await self._replace("allocator", new)
        if self.spec.admission_webhook and self.api is not None:
            # The same URL and certificate; registered again so the API server calls the new one.
            registered = MutatingWebhook.from_configuration(
                WEBHOOK_CONFIGURATION, new.webhook_url, self._webhook_ca
            )
            self.api.admission = MutatingAdmission([registered])
        # It knows a node from the agent's next heartbeat: restarted = placing again, so wait
        # for them (bounded; a node still missing is refused with a reason meanwhile).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2 * self.spec.heartbeat_s + 1):
                while len(new.inventory.nodes()) < len(self.agents):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)

    def _node_labels(self, name: str) -> MemoryNodeLabeler:
        """The simulated Node's labels, as a cluster's agent reads them from the API."""
        return MemoryNodeLabeler(self.spec.node_labels.get(name, {}))

    async def _restart_agent(self, name: str) -> None:
        """Again from its settings: it re-registers with its kubelet and, from its records in
        state_dir, serves the containers it served (services/nodeagent/service.py)."""
        old = self.agents[name]
        await _stop_quietly(old)
        agent = NodeAgent(self._agent_settings[name], labeler=self._node_labels(name))
        await agent.start()
        self._started[self._started.index(old)] = agent
        self.agents[name] = agent

    async def _restart_nats(self) -> None:
        assert self.nats is not None
        await self.nats.start_async()  # same port and store: clients reconnect, nothing lost

    async def _run(self, make: Callable[[int], Service], port: int, what: str) -> Service:
        service = await _start_on_port(make, port, what)
        self._started.append(service)
        return service

    async def _start_node(self, name: str, nats_url: str, hook_library: str) -> None:
        root = self.work_dir / name
        plugin_dir = root / "device-plugins"
        pod_resources = root / "pod-resources"
        for directory in (plugin_dir, pod_resources, root / "containers"):
            directory.mkdir(parents=True)
        self.sim_state_dir(name).mkdir()
        os.chmod(self.sim_state_dir(name), 0o1777)  # container processes run as any user
        mig = self._mig
        mig_settings = (
            {}
            if mig is None
            else {
                "simulate_mig": mig.geometry,
                "mig_dynamic": mig.dynamic,
                "mig_strategy": mig.strategy,
            }
        )
        kubelet = KubeletSimulator(
            KubeletSimSettings(
                node_name=name,
                plugin_dir=str(plugin_dir),
                pod_resources_socket=str(pod_resources / "kubelet.sock"),
                device_resources=(RESOURCE,),
            )
        )
        await kubelet.start()
        self._started.append(kubelet)
        self.kubelets[name] = kubelet
        settings = self._agent_settings[name] = NodeAgentSettings(
            node_name=name,
            nats_url=nats_url,
            simulate=self.spec.simulate,
            simulate_driver_dir=str(self.sim_state_dir(name)),
            plugin_dir=str(plugin_dir),
            pod_resources_socket=str(pod_resources / "kubelet.sock"),
            container_root=str(root / "containers"),
            state_dir=str(root / "agent-state"),
            hook_library=hook_library,
            split_count=self.spec.split_count,
            memory_scaling=self.spec.memory_scaling,
            cores_scaling=self.spec.cores_scaling,
            heartbeat_s=self.spec.heartbeat_s,
            sharing_mode=self.spec.mode,
            # No GPU here: the MPS control daemons are the simulated control program.
            mps_root=str(root / "mps"),
            mps_control=SIMULATED_MPS_CONTROL,
            **mig_settings,
        )
        agent = NodeAgent(settings, labeler=self._node_labels(name))
        await agent.start()
        self._started.append(agent)
        self.agents[name] = agent

    async def _wait_ready(self, timeout_s: float) -> None:
        """Ready = every kubelet sees our resources (MIG ones too) and the allocator knows
        every node."""
        async with asyncio.timeout(timeout_s):
            for name, kubelet in self.kubelets.items():
                for resource in self.agents[name].resources or [RESOURCE]:
                    await kubelet.wait_for_resource(resource, timeout_s)
            assert self.allocator is not None
            # The allocator offers no event for this; a short poll at start-up is enough.
            while len(self.allocator.inventory.nodes()) < len(self.agents):  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    def state(self) -> UpState:
        assert self.allocator is not None and self.metrics is not None and self.api is not None
        return UpState(
            nats_url=self.nats_url,
            api_url=self.api.url,
            allocator_url=self.allocator.url,
            metrics_url=self.metrics.url,
            extender_url=self.allocator.extender_url,
            ca_file=self.pki.ca_file if self.pki else "",
            client_cert_file=self.pki.client_cert_file if self.pki else "",
            client_key_file=self.pki.client_key_file if self.pki else "",
            kubelets={name: kubelet.url for name, kubelet in self.kubelets.items()},
            work_dir=str(self.work_dir),
            pid=os.getpid(),
            gpus={
                name: [UpGpu(gpu.uuid, gpu.memory_mib) for gpu in agent.gpus]
                for name, agent in self.agents.items()
            },
            driver_dir=str(Path(self.spec.hook_library).parent / "sim"),
            sim_state_dirs={name: str(self.sim_state_dir(name)) for name in self.agents},
            nats_store_dir=self.nats.store_dir if self.nats is not None else "",
            users_file=str(self.users.path) if self.users is not None else "",
            admin_token=self.admin_token,
        )

    @property
    def admin_token(self) -> str:
        """The cluster-admin's bearer token ("" when the read APIs are open)."""
        if self.users is None:
            return ""
        return admin_token(self.users.current(), self.users.path)

    def sim_state_dir(self, node: str) -> Path:
        """Where the simulated devices of `node` keep what every process on them shares."""
        return self.work_dir / node / "gpu-state"

    async def stop(self) -> None:
        """Stop everything started, newest first; one failure does not strand the rest."""
        supervisors, self._supervisors = self._supervisors, []
        if self._nats_supervisor is not None:
            supervisors.append(self._nats_supervisor)
            self._nats_supervisor = None
        for supervisor in supervisors:  # first, or they would restart what we stop
            supervisor.cancel()
        for supervisor in supervisors:
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        follower, self._kubelet_follower = self._kubelet_follower, None
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower
        while self._started:
            service = self._started.pop()
            try:
                await service.stop()
            except Exception:
                log.exception(
                    "stopping a service failed", extra={"service": type(service).__name__}
                )
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.work_dir)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.tls_dir)  # its keys are of no use to anyone after the stop
