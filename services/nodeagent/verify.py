"""Verification from outside: what NVML measures for each container, against its slice and
against what its hooks say.

The hook keeps cooperative programs inside their slice; only the agent can notice a program
that bypasses the hook (calls the driver directly, runs without the preload) or fools it
(zeroes the shared region, forges relay messages). On every NVML sample the agent sums the
per-process memory of each container's processes per GPU (host PIDs mapped to containers by
process_map.py) and checks:

- **over_limit**: measured > limit + tolerance, with tolerance = max(tolerance_percent of the
  limit, per-process allowance x the container's processes on that GPU); the allowance is
  `violation_tolerance_mib`, or the limit file's `context_overhead_mib` when that is 0 (a
  context's own footprint shows in NVML but in no allocation call). Unlimited slices
  (limit 0) are never over.
- **tampering**: a hook's `hello` states limits other than those the agent wrote, or the
  hooks' latest `usage` (the container's total) is below the measured figure by more than
  the tolerance.

- **over_compute**: the SM share NVML samples for the container's processes is above its
  cores share plus `ComputeCheck.tolerance_percent` points while something else wants the GPU
  (the GPU's utilisation beyond the container's own is over CONTENDED_PERCENT, the rule the
  hook's work conservation follows), or at any time with compute policy `hard`. It is what a
  program launching behind the limiter's back (no preload, direct driver calls, a rewritten
  clock) shows. Reported only, never killed: compute taken cannot be handed back, and the
  honest tenants meanwhile still get their GPU time from the hardware's time-slicing.

A finding counts once it has held for `confirm_s` and at least two samples (NVML and the
hooks' reports are not taken at the same instant); a `hello` that lies counts at once. Each
new finding is published on `vgpu.v1.violation.<node>` (SliceViolation), logged with
pod/container/GPU/reason, counted, and kept in gauges and in the container's usage while it
stands. With `on_violation=kill` an over_limit finding SIGKILLs the container's processes on
that GPU, newest first, until the rest fit within limit + tolerance (checked again on every
sample while the finding stands).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import trace
from prometheus_client import Counter, Gauge

from services.common import subjects
from services.common.bus import Bus
from services.common.schemas import SliceViolation, ViolationKind
from services.common.tracing import tracer
from services.nodeagent.containers import ResolvedContainer
from services.nodeagent.gpus.backend import GpuProcess
from services.nodeagent.limits_file import DeviceLimit
from services.nodeagent.process_map import ContainerProcesses
from services.nodeagent.relay import HookClaims

log = logging.getLogger("vgpu.nodeagent")
_tracer = tracer("vgpu.nodeagent")

ACTIONS = ("report", "kill")
MIN_SAMPLES = 2
# The GPU's utilisation beyond a container's own above which others want the GPU (the hook's
# work conservation uses the same 5 points: libvgpu-hook/README.md, "Compute limiter").
CONTENDED_PERCENT = 5.0

VIOLATION = Gauge(
    "vgpu_nodeagent_slice_violation",
    "1 while the agent's verification finds a container breaking its slice on a GPU "
    "(kind over_limit: NVML shows more than the slice; tampering: its hook's figures lie)",
    ["node", "namespace", "pod", "container", "gpu", "kind"],
)
MEASURED = Gauge(
    "vgpu_nodeagent_container_measured_memory_mib",
    "Device memory NVML shows for a container's processes on a GPU",
    ["node", "namespace", "pod", "container", "gpu"],
)
EXCESS = Gauge(
    "vgpu_nodeagent_slice_excess_mib",
    "Device memory NVML shows for a container beyond its slice (0 when within)",
    ["node", "namespace", "pod", "container", "gpu"],
)
MEASURED_SM = Gauge(
    "vgpu_nodeagent_container_measured_sm_percent",
    "SM share NVML samples for a container's processes on a GPU (percent of the GPU)",
    ["node", "namespace", "pod", "container", "gpu"],
)
VIOLATIONS = Counter(
    "vgpu_nodeagent_violations_total",
    "Slice violations found by the agent's verification",
    ["node", "kind", "action"],
)
KILLED = Counter(
    "vgpu_nodeagent_violation_kills_total",
    "Processes SIGKILLed because their container was over its slice",
    ["node"],
)


def start_ticks(pid: int, proc_root: Path) -> int | None:
    """When the process started (clock ticks since boot); None when it is gone."""
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


@dataclass
class _Finding:
    since: float = 0.0  # monotonic time the condition was first seen; 0 = not holding
    samples: int = 0
    active: bool = False

    def hold(self, now: float, confirm_s: float) -> bool:
        """The condition holds in this sample; True once it has held long enough."""
        if self.samples == 0:
            self.since = now
        self.samples += 1
        return self.samples >= MIN_SAMPLES and now - self.since >= confirm_s

    def clear(self) -> bool:
        """The condition does not hold; True if a standing finding ended."""
        ended = self.active
        self.since, self.samples, self.active = 0.0, 0, False
        return ended


@dataclass(frozen=True)
class ComputeCheck:
    """How the SM share is judged: `policy` is the hook's compute policy (share: over-use
    counts only while others want the GPU; hard: always; off: never checked)."""

    policy: str = "share"
    tolerance_percent: float = 10.0  # points of the GPU above the cores share
    confirm_s: float = 6.0

    def over(self, cores: int, own: float, gpu_total: float) -> bool:
        if cores <= 0 or self.policy == "off" or own < 0:
            return False
        contended = self.policy == "hard" or gpu_total - own > CONTENDED_PERCENT
        return contended and own > cores + self.tolerance_percent


@dataclass
class _Device:
    over: _Finding = field(default_factory=_Finding)
    disagree: _Finding = field(default_factory=_Finding)
    compute: _Finding = field(default_factory=_Finding)
    hello_lies: set[int | None] = field(default_factory=set)  # peers already reported
    labels: tuple[str, ...] = ()


class Verifier:
    def __init__(
        self,
        *,
        node_name: str,
        bus: Bus,
        on_violation: str = "report",
        tolerance_percent: float = 5.0,
        tolerance_mib: int = 0,
        confirm_s: float = 1.0,
        compute: ComputeCheck | None = None,
        report_fresh_s: float = 2.0,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        if on_violation not in ACTIONS:
            raise ValueError(f"on_violation must be report or kill, got {on_violation!r}")
        self._node = node_name
        self._bus = bus
        self._action = on_violation
        self._percent = tolerance_percent
        self._per_process = tolerance_mib
        self._confirm_s = confirm_s
        self._compute = compute or ComputeCheck()
        self._fresh_s = report_fresh_s
        self._proc = proc_root
        self._clock = clock
        self._kill = kill
        self._devices: dict[tuple[str, str], _Device] = {}  # (key, uuid)
        self.sent: list[SliceViolation] = []  # the latest few, newest last (for inspection)

    def tolerance(self, container: ResolvedContainer, limit_mib: int, processes: int) -> int:
        per_process = self._per_process or container.limits.context_overhead_mib
        return max(math.ceil(limit_mib * self._percent / 100), per_process * processes)

    def flags(self, key: str) -> dict[str, str]:
        """Standing findings of one container per GPU uuid ("over_limit,tampering")."""
        found: dict[str, str] = {}
        for (owner, uuid), device in self._devices.items():
            kinds = [k for k, f in (("over_limit", device.over), ("tampering", device.disagree))
                     if f.active]  # fmt: skip
            if device.hello_lies and "tampering" not in kinds:
                kinds.append("tampering")
            if device.compute.active:
                kinds.append("over_compute")
            if owner == key and kinds:
                found[uuid] = ",".join(kinds)
        return found

    def forget(self, key: str) -> None:
        """The container is gone: drop its state and its gauges."""
        for owner, uuid in [k for k in self._devices if k[0] == key]:
            device = self._devices.pop((owner, uuid))
            if device.labels:
                for gauge in (MEASURED, EXCESS, MEASURED_SM):
                    _remove(gauge, device.labels)
                for kind in ("over_limit", "tampering", "over_compute"):
                    _remove(VIOLATION, (*device.labels, kind))

    def forget_all(self) -> None:
        """The agent stops: its gauges must not outlive it in a process that starts another
        (vgpu up restarts a crashed agent in place)."""
        for key in {owner for owner, _ in self._devices}:
            self.forget(key)

    async def check(
        self,
        containers: list[ResolvedContainer],
        assigned: ContainerProcesses,
        claims: Callable[[str], HookClaims | None],
        gpu_sm: dict[str, float] | None = None,
    ) -> list[SliceViolation]:
        """One NVML sample: check every container; the new findings (already published).
        `gpu_sm` is each GPU's SM utilisation in the sample (uuid -> percent); without it
        compute is not judged."""
        now = self._clock()
        found: list[SliceViolation] = []
        live = set()
        for container in containers:
            hooks = claims(container.key)
            for ordinal, limit in enumerate(container.limits.devices):
                live.add((container.key, limit.uuid))
                processes = assigned.get(container.key, {}).get(limit.uuid, [])
                found += self._check_device(container, ordinal, limit, processes, hooks, now)
                found += self._check_compute(container, limit, processes, gpu_sm, now)
        for key in {owner for owner, uuid in self._devices if (owner, uuid) not in live}:
            self.forget(key)
        for violation in found:
            await self._publish(violation)
        return found

    def _check_device(
        self,
        container: ResolvedContainer,
        ordinal: int,
        limit: DeviceLimit,
        processes: list[GpuProcess],
        hooks: HookClaims | None,
        now: float,
    ) -> list[SliceViolation]:
        device = self._devices.setdefault((container.key, limit.uuid), _Device())
        labels = (self._node, container.limits.namespace, container.limits.pod,
                  container.limits.container, limit.uuid)  # fmt: skip
        device.labels = labels
        measured = sum(p.memory_used_mib for p in processes)
        tolerance = self.tolerance(container, limit.memory_limit_mib, len(processes))
        MEASURED.labels(*labels).set(measured)
        excess = max(0, measured - limit.memory_limit_mib) if limit.memory_limit_mib else 0
        EXCESS.labels(*labels).set(excess)
        found: list[SliceViolation] = []

        def finding(kind: ViolationKind, reason: str, reported: int = -1) -> SliceViolation:
            return SliceViolation(
                node=self._node, namespace=container.limits.namespace,
                pod=container.limits.pod, container=container.limits.container,
                gpu=limit.uuid, kind=kind, reason=reason, limit_mib=limit.memory_limit_mib,
                measured_mib=measured, tolerance_mib=tolerance, reported_mib=reported,
                pids=sorted(p.pid for p in processes),
            )  # fmt: skip

        # Over the slice, by NVML.
        over = limit.memory_limit_mib > 0 and measured > limit.memory_limit_mib + tolerance
        if over and device.over.hold(now, self._confirm_s):
            killed = self._enforce(container, limit, processes, tolerance)
            if not device.over.active or killed:
                device.over.active = True
                reason = (
                    f"NVML shows {measured} MiB for the container's processes on the GPU, "
                    f"over its slice of {limit.memory_limit_mib} MiB + {tolerance} MiB tolerance"
                )
                violation = finding("over_limit", reason)
                violation.action = "kill" if self._action == "kill" else "report"
                violation.killed_pids = killed
                found.append(violation)
        elif not over and device.over.clear():
            self._log_cleared(container, limit, "over_limit", measured)
        VIOLATION.labels(*labels, "over_limit").set(1 if device.over.active else 0)

        # The hooks' own figures against the agent's.
        lies = self._hello_lies(container, ordinal, limit, hooks)
        for peer, reason in lies:
            if peer not in device.hello_lies:
                device.hello_lies.add(peer)
                found.append(finding("tampering", reason))
        if not lies:
            device.hello_lies.clear()
        reported = self._reported(hooks, ordinal, now)
        disagree = reported is not None and measured - reported > tolerance
        if disagree and device.disagree.hold(now, self._confirm_s) and not device.disagree.active:
            device.disagree.active = True
            reason = (
                f"the container's hooks report {reported} MiB on the GPU while NVML shows "
                f"{measured} MiB for its processes (tolerance {tolerance} MiB): a process "
                "bypasses the hook or the shared accounting was tampered with"
            )
            found.append(finding("tampering", reason, reported if reported is not None else -1))
        elif not disagree and device.disagree.clear():
            self._log_cleared(container, limit, "tampering", measured)
        tampering = device.disagree.active or bool(device.hello_lies)
        VIOLATION.labels(*labels, "tampering").set(1 if tampering else 0)
        return found

    def _check_compute(
        self,
        container: ResolvedContainer,
        limit: DeviceLimit,
        processes: list[GpuProcess],
        gpu_sm: dict[str, float] | None,
        now: float,
    ) -> list[SliceViolation]:
        device = self._devices[(container.key, limit.uuid)]
        sampled = [p.sm_util_percent for p in processes if p.sm_util_percent >= 0]
        own = round(sum(sampled), 2) if sampled else -1.0
        total = (gpu_sm or {}).get(limit.uuid, -1.0)
        if own >= 0:
            MEASURED_SM.labels(*device.labels).set(own)
        over = total >= 0 and self._compute.over(limit.cores, own, total)
        found: list[SliceViolation] = []
        if over and device.compute.hold(now, self._compute.confirm_s):
            if not device.compute.active:
                device.compute.active = True
                others = round(max(0.0, total - own), 2)
                why = "compute policy hard" if self._compute.policy == "hard" else (
                    f"while the rest of the GPU is {others}% busy"
                )  # fmt: skip
                reason = (
                    f"NVML shows the container's processes on the GPU at {own}% SM, over its "
                    f"cores share of {limit.cores}% + {self._compute.tolerance_percent:g} "
                    f"points, {why}: a process launches behind the hook's limiter"
                )
                found.append(SliceViolation(
                    node=self._node, namespace=container.limits.namespace,
                    pod=container.limits.pod, container=container.limits.container,
                    gpu=limit.uuid, kind="over_compute", reason=reason,
                    limit_mib=limit.memory_limit_mib,
                    measured_mib=sum(p.memory_used_mib for p in processes), tolerance_mib=0,
                    pids=sorted(p.pid for p in processes), cores_limit=limit.cores,
                    measured_sm_percent=own, others_sm_percent=others,
                ))  # fmt: skip
        elif not over and device.compute.clear():
            self._log_cleared(container, limit, "over_compute", own)
        VIOLATION.labels(*device.labels, "over_compute").set(1 if device.compute.active else 0)
        return found

    def _reported(self, hooks: HookClaims | None, ordinal: int, now: float) -> int | None:
        """The hooks' latest container total on the device, if recent enough to compare."""
        if hooks is None or not hooks.hellos or ordinal not in hooks.used_mib:
            return None
        if now - hooks.reported_at > self._fresh_s:
            return None
        return hooks.used_mib[ordinal]

    @staticmethod
    def _hello_lies(
        container: ResolvedContainer, ordinal: int, limit: DeviceLimit, hooks: HookClaims | None
    ) -> list[tuple[int | None, str]]:
        lies: list[tuple[int | None, str]] = []
        for peer, hello in hooks.hellos if hooks else []:
            for stated in hello.devices:
                if stated.index != ordinal:
                    continue
                if (stated.limit_mib, stated.cores) != (limit.memory_limit_mib, limit.cores) or (
                    stated.uuid and stated.uuid != limit.uuid
                ):
                    lies.append((peer, (
                        f"the hook of host PID {peer} says device {ordinal} is {stated.uuid} "
                        f"with {stated.limit_mib} MiB and {stated.cores}% cores; the agent "
                        f"wrote {limit.uuid} with {limit.memory_limit_mib} MiB and "
                        f"{limit.cores}% cores"
                    )))  # fmt: skip
        return lies

    def _enforce(
        self,
        container: ResolvedContainer,
        limit: DeviceLimit,
        processes: list[GpuProcess],
        tolerance: int,
    ) -> list[int]:
        """With on_violation=kill: SIGKILL newest first until the rest fit; the PIDs killed."""
        if self._action != "kill":
            return []
        started = {p.pid: start_ticks(p.pid, self._proc) for p in processes}
        newest_first = sorted(  # same clock tick: the higher PID is most likely the newer
            (p for p in processes if started[p.pid] is not None and p.pid > 1),
            key=lambda p: (started[p.pid] or 0, p.pid),
            reverse=True,
        )
        remaining = sum(p.memory_used_mib for p in processes)
        killed: list[int] = []
        for process in newest_first:
            if remaining <= limit.memory_limit_mib + tolerance:
                break
            if (
                process.pid == os.getpid()
                or start_ticks(process.pid, self._proc) != started[process.pid]
            ):
                continue  # gone, or its PID now names another process
            try:
                self._kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it died on its own: its memory is free all the same
            except PermissionError as exc:
                log.error(
                    "cannot kill a process over its container's slice",
                    extra=self._fields(container, limit, pid=process.pid, error=str(exc)),
                )
                continue
            remaining -= process.memory_used_mib
            killed.append(process.pid)
            KILLED.labels(node=self._node).inc()
            log.warning(
                "killed a process of a container over its slice",
                extra=self._fields(
                    container,
                    limit,
                    pid=process.pid,
                    memory_mib=process.memory_used_mib,
                    reason=f"container over its {limit.memory_limit_mib} MiB slice",
                ),
            )
        return killed

    def _fields(self, container: ResolvedContainer, limit: DeviceLimit, **extra: object) -> dict:
        return {
            "node": self._node,
            "namespace": container.limits.namespace,
            "pod": container.limits.pod,
            "container": container.limits.container,
            "gpu": limit.uuid,
            **extra,
        }

    def _log_cleared(
        self, container: ResolvedContainer, limit: DeviceLimit, kind: str, measured: float
    ) -> None:
        figure = "measured_sm_percent" if kind == "over_compute" else "measured_mib"
        log.info(
            "slice violation ended",
            extra=self._fields(container, limit, kind=kind, **{figure: measured}),
        )

    async def _publish(self, violation: SliceViolation) -> None:
        VIOLATIONS.labels(node=self._node, kind=violation.kind, action=violation.action).inc()
        log.warning(
            "slice violation: " + violation.reason,
            extra={
                "node": violation.node,
                "namespace": violation.namespace,
                "pod": violation.pod,
                "container": violation.container,
                "gpu": violation.gpu,
                "kind": violation.kind,
                "reason": violation.reason,
                "action": violation.action,
                "pids": violation.pids,
                "killed_pids": violation.killed_pids,
            },
        )
        self.sent = [*self.sent[-63:], violation]
        with _tracer.start_as_current_span("slice violation") as span:
            span.set_attribute("vgpu.kind", violation.kind)
            span.set_attribute("k8s.namespace.name", violation.namespace)
            span.set_attribute("k8s.pod.name", violation.pod)
            span.set_attribute("k8s.container.name", violation.container)
            span.set_attribute("vgpu.gpu", violation.gpu)
            span.set_status(trace.Status(trace.StatusCode.ERROR, violation.reason))
            try:
                await self._bus.publish(subjects.violations(self._node), violation)
            except Exception as exc:  # the finding stands in gauges and logs regardless
                log.error("cannot publish a slice violation", extra={
                    "node": violation.node, "namespace": violation.namespace, "pod": violation.pod,
                    "container": violation.container, "gpu": violation.gpu,
                    "kind": violation.kind, "error": str(exc)})  # fmt: skip


def _remove(gauge: Gauge, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)
