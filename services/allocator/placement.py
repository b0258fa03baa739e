"""Where a pod's containers go on one node. Pure: no I/O, no clock.

Fit is the same for every policy: each container needs ``gpus`` distinct healthy GPUs that
the pod's selection allows, each with the slice's memory, compute share (100 per GPU) and one
task slot free. The policy only ranks the sets that fit.

Init containers run one after another before the app containers, and the kubelet hands an
init container's devices on to the app containers, so a pod holds on each GPU the larger of
(sum of its app containers' slices) and (the largest init container slice): init containers
ride for free on what the app containers get whenever they fit inside it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from services.common import mig
from services.common.resources import AWS_VGPU, GPU, GPU_CORES, GPU_MEMORY, GPU_MEMORY_PERCENT
from services.common.schemas import ContainerAllocation, ContainerRequest, GpuSlice
from services.common.sharing import TIME_SLICING, VGPU

from . import mig_fit
from .cluster import FULL_COMPUTE, Charge, GpuState, NodeState
from .modes import memory_needed, refusal, slice_need
from .pod_request import NUMA_BIND, PodRequest
from .policies import Policy, ScoreContext, Trial

_ZERO = Charge()
MAX_COMBINATIONS = 128  # beyond this many GPU sets, choose greedily GPU by GPU


class NoFit(Exception):
    """A container cannot be placed; the message names the container and its request."""

    def __init__(self, request: ContainerRequest | None, detail: str) -> None:
        self.request = request
        self.detail = detail
        if request is None:
            super().__init__(detail)
        else:
            super().__init__(
                f"container {request.container!r} ({describe_request(request)}) {detail}"
            )


def describe_request(request: ContainerRequest) -> str:
    """The request as the pod spec states it, e.g. 'nvidia.com/gpu: 2, nvidia.com/gpumem: 8000'."""
    if request.vgpus:
        return f"{AWS_VGPU}: {request.vgpus}"
    parts = [f"{GPU}: {request.gpus}"]
    if request.memory_mib:
        parts.append(f"{GPU_MEMORY}: {request.memory_mib}")
    if request.memory_percent:
        parts.append(f"{GPU_MEMORY_PERCENT}: {request.memory_percent}")
    whole_gpus = request.cores == FULL_COMPUTE and len(parts) == 1  # a bare nvidia.com/gpu
    if request.cores and not whole_gpus:
        parts.append(f"{GPU_CORES}: {request.cores}")
    return ", ".join(parts)


def need_text(request: ContainerRequest) -> str:
    if request.vgpus:
        return f"1 GPU with {request.vgpus} of its vGPUs (its split count's share)"
    if request.equal_share:
        memory = "an equal share of its memory"
    elif request.memory_mib:
        memory = f"{request.memory_mib} MiB"
    elif request.memory_percent:
        memory = f"{request.memory_percent}% of its memory"
    else:
        memory = "all of its memory"
    compute = f" and {request.cores}% compute" if request.cores else ""
    plural = "GPU" if request.gpus == 1 else "GPUs"
    return f"{request.gpus} {plural} each with {memory}{compute}"


def slice_charge(request: ContainerRequest, gpu: GpuState) -> Charge:
    """What one slice holds on `gpu` in its sharing mode (modes.py); NoFit if the mode
    cannot serve the request."""
    need = slice_need(request, gpu)
    if need is None:
        raise NoFit(request, f"cannot use GPU {gpu.uuid}: {refusal(gpu, request)}")
    return Charge(need[0], need[1], 1)


def _max(a: Charge, b: Charge) -> Charge:
    # Init containers never hold MIG instances (_Placer._mig_fit): the masks do not meet.
    return Charge(
        max(a.memory_mib, b.memory_mib),
        max(a.cores, b.cores),
        max(a.slots, b.slots),
        a.mig_mask | b.mig_mask,
    )


def pod_charges(containers: Mapping[str, ContainerAllocation]) -> dict[str, Charge]:
    """What a pod holds per GPU: max(sum of app slices, largest init slice), per resource."""
    app: dict[str, Charge] = {}
    init: dict[str, Charge] = {}
    for container in containers.values():
        for piece in container.slices:
            charge = Charge(piece.memory_mib, piece.cores, 1, mig_fit.slice_mask(piece))
            if container.init:
                init[piece.uuid] = _max(init.get(piece.uuid, Charge()), charge)
            else:
                app[piece.uuid] = app.get(piece.uuid, Charge()) + charge
    return {
        uuid: _max(app.get(uuid, Charge()), init.get(uuid, Charge()))
        for uuid in dict.fromkeys([*app, *init])
    }


def _within(gpu: GpuState, used: Charge) -> bool:
    return (
        used.memory_mib <= gpu.memory_mib and used.cores <= gpu.compute and used.slots <= gpu.slots
    )


@dataclass
class NodePlacement:
    node: str
    slices: dict[str, list[GpuSlice]]  # container name -> slices, in the pod's order
    charges: dict[str, Charge]  # GPU uuid -> what the pod holds there
    trial: Trial = field(repr=False)


class _Placer:
    """Places one pod's containers on one node, app containers first, then init containers."""

    def __init__(
        self, node: NodeState, pod: PodRequest, policy: Policy, ctx: ScoreContext, empty: bool
    ) -> None:
        self.node = node
        self.pod = pod
        self.policy = policy
        self.ctx = ctx
        self.empty = empty
        self.app: dict[str, Charge] = {}
        self.init: dict[str, Charge] = {}
        self.trial = Trial(node, extra={}, empty=empty)
        self.refused: dict[str, str] = {}  # sharing mode -> why it cannot serve a request

    def _base(self, gpu: GpuState) -> Charge:
        return Charge() if self.empty else gpu.used

    def _add(self, request: ContainerRequest, gpu: GpuState) -> Charge | None:
        """The extra charge of one more slice of `request` on `gpu`, or None if it won't fit.

        Plain integers on purpose: this runs for every GPU of every node a new shape meets."""
        if gpu.device.mig_dynamic:
            return self._add_mig(request, gpu)
        if gpu.device.sharing_mode == VGPU and not request.vgpus:
            need = memory_needed(request, gpu)
            cores = request.cores
        else:
            by_mode = slice_need(request, gpu)
            if by_mode is None:
                self.refused[gpu.sharing_mode] = refusal(gpu, request)
                return None
            need, cores = by_mode
        uuid = gpu.uuid
        am, ac, an, _ = self.app.get(uuid) or _ZERO
        im, ic, inn, _ = self.init.get(uuid) or _ZERO
        if request.init:
            im, ic, inn = max(im, need), max(ic, cores), max(inn, 1)
        else:
            am, ac, an = am + need, ac + cores, an + 1
        tm, tc, tn = max(am, im), max(ac, ic), max(an, inn)
        um, uc, un, _ = _ZERO if self.empty else gpu.used
        if um + tm > gpu.memory_mib or uc + tc > gpu.compute or un + tn > gpu.slots:
            return None
        em, ec, en, _ = self.trial.extra.get(uuid) or _ZERO
        return Charge(tm - em, tc - ec, tn - en)

    def _mig_fit(
        self, request: ContainerRequest, gpu: GpuState
    ) -> tuple[Charge, mig.GiProfile, int] | None:
        """Dynamic MIG: the charge of the smallest MIG instance holding the request, at the
        start that leaves the most room (mig_fit.py), or None. Not for init containers: the
        kubelet hands their devices on to the app containers, which a MIG instance made for
        one container cannot follow."""
        if request.init:
            return None
        held = self.app.get(gpu.uuid) or _ZERO
        used = _ZERO if self.empty else gpu.used
        if used.slots + held.slots + 1 > gpu.slots:
            return None
        occupied = held.mig_mask | (0 if self.empty else used.mig_mask | gpu.mig_live_mask)
        found = mig_fit.fit(gpu.device.model, memory_needed(request, gpu), occupied)
        if found is None:
            return None
        profile, start = found
        charge = Charge(
            profile.memory_mib,
            mig_fit.mig_cores(profile),
            1,
            mig_fit.mask_of(start, profile.memory_slices),
        )
        return charge, profile, start

    def _add_mig(self, request: ContainerRequest, gpu: GpuState) -> Charge | None:
        found = self._mig_fit(request, gpu)
        return None if found is None else found[0]

    def _record(self, request: ContainerRequest, gpus: Sequence[GpuState]) -> list[GpuSlice]:
        slices = []
        for gpu in gpus:
            mig_found = self._mig_fit(request, gpu) if gpu.device.mig_dynamic else None
            need = slice_charge(request, gpu) if mig_found is None else mig_found[0]
            uuid = gpu.uuid
            if request.init:
                self.init[uuid] = _max(self.init.get(uuid, Charge()), need)
            else:
                self.app[uuid] = self.app.get(uuid, Charge()) + need
            self.trial.changed()
            self.trial.extra[uuid] = _max(
                self.app.get(uuid, Charge()), self.init.get(uuid, Charge())
            )
            piece = GpuSlice(
                uuid=uuid, index=gpu.index, memory_mib=need.memory_mib, cores=need.cores
            )
            if mig_found is not None:
                piece = msgspec.structs.replace(
                    piece, mig_profile=mig_found[1].name, mig_start=mig_found[2]
                )
            slices.append(piece)
        return slices

    def _choose(
        self, request: ContainerRequest, candidates: list[tuple[GpuState, Charge]]
    ) -> list[GpuState] | None:
        k = request.gpus
        if candidates and all(p[0].sharing_mode == TIME_SLICING for p in candidates):
            return self._least_shared(k, [p[0] for p in candidates])
        groups: list[list[tuple[GpuState, Charge]]]
        if self.pod.numa_bind and k > 1:
            by_numa: dict[int, list[tuple[GpuState, Charge]]] = {}
            for pair in candidates:
                by_numa.setdefault(pair[0].device.numa_node, []).append(pair)
            groups = [g for g in by_numa.values() if len(g) >= k]
        else:
            groups = [candidates] if len(candidates) >= k else []
        best: tuple[GpuState, ...] | None = None
        best_score = -math.inf
        for group in groups:
            if k == 1:
                sets = [(pair,) for pair in group]
            elif math.comb(len(group), k) <= MAX_COMBINATIONS:
                sets = list(itertools.combinations(group, k))
            else:
                ranked = sorted(
                    group,
                    key=lambda p: -self.policy.gpu_score(self.ctx, self.trial, (p[0],), (p[1],)),
                )
                sets = [tuple(ranked[:k])]
            for chosen in sets:
                gpus = tuple(p[0] for p in chosen)
                score = self.policy.gpu_score(
                    self.ctx, self.trial, gpus, tuple(p[1] for p in chosen)
                )
                if score > best_score + 1e-12:
                    best, best_score = gpus, score
        return None if best is None else list(best)

    def _least_shared(self, k: int, gpus: list[GpuState]) -> list[GpuState] | None:
        """Replicas without limits contend for the whole GPU: spread them, the GPU with the
        fewest replicas taken first (NVIDIA's `distributed` policy), then index order."""
        if len(gpus) < k:
            return None

        def taken(gpu: GpuState) -> int:
            base = 0 if self.empty else gpu.used.slots
            return base + (self.trial.extra.get(gpu.uuid) or _ZERO).slots

        return sorted(gpus, key=lambda g: (taken(g), g.index))[:k]

    def _no_room(self, request: ContainerRequest, roomy: int) -> NoFit:
        gpus = self.node.gpus
        notes = []
        for mode, why in sorted(self.refused.items()):
            count = sum(g.sharing_mode == mode for g in gpus)
            notes.append(f"{count} in {mode} mode refuse it ({why})")
        if not self.empty:
            unhealthy = sum(not g.healthy for g in gpus)
            if unhealthy:
                notes.append(f"{unhealthy} unhealthy")
        selection = self.pod.selection
        if selection.restricts:
            excluded = sum(not selection.allows(g.device) for g in gpus)
            if excluded:
                notes.append(f"{excluded} excluded by {selection.describe()}")
        extra = f", {', '.join(notes)}" if notes else ""
        detail = (
            f"needs {need_text(request)} free; {roomy} of {len(gpus)} GPUs have that room{extra}"
        )
        if self.pod.numa_bind and request.gpus > 1 and roomy >= request.gpus:
            detail += f", but no NUMA node has {request.gpus} of them ({NUMA_BIND})"
        return NoFit(request, detail)

    def place_one(self, request: ContainerRequest) -> list[GpuSlice]:
        selection = self.pod.selection
        candidates: list[tuple[GpuState, Charge]] = []
        for gpu in self.node.gpus:
            if not (self.empty or gpu.healthy):
                continue
            if selection.restricts and not selection.allows(gpu.device):
                continue
            add = self._add(request, gpu)
            if add is not None:
                candidates.append((gpu, add))
        chosen = self._choose(request, candidates)
        if chosen is None:
            raise self._no_room(request, len(candidates))
        return self._record(request, chosen)

    def place(self) -> NodePlacement:
        node, pod = self.node, self.pod
        placed: dict[str, list[GpuSlice]] = {}
        for request in (*pod.app, *pod.init):  # app first: init containers reuse their GPUs
            placed[request.container] = self.place_one(request)
        slices = {r.container: placed[r.container] for r in pod.containers}
        return NodePlacement(node.name, slices, dict(self.trial.extra), self.trial)


def host_problem(node: NodeState, pod: PodRequest, empty: bool = False) -> str | None:
    """Why the node's CPU, memory or pod slots (when known) cannot take the pod."""
    if node.max_pods and not empty and node.used_pods >= node.max_pods:
        return f"the node already runs {node.used_pods} pods, its most ({node.max_pods})"
    if pod.cpu_milli and node.cpu_milli:
        free = node.cpu_milli - (0 if empty else node.used_cpu_milli)
        if pod.cpu_milli > free:
            return f"the pod needs {pod.cpu_milli}m CPU; {free}m of {node.cpu_milli}m free"
    if pod.memory_mib and node.host_memory_mib:
        free = node.host_memory_mib - (0 if empty else node.used_memory_mib)
        if pod.memory_mib > free:
            return f"the pod needs {pod.memory_mib} MiB of host memory; {free} MiB free"
    return None


def place_pod(
    node: NodeState,
    pod: PodRequest,
    policy: Policy,
    ctx: ScoreContext,
    empty: bool = False,
) -> NodePlacement:
    """The pod's slices on `node` as `policy` prefers them; NoFit naming the first container
    that does not fit. `empty` asks whether it could ever fit: as if the node were idle and
    healthy."""
    return _Placer(node, pod, policy, ctx, empty).place()


def slices_on(request: ContainerRequest, gpus: Sequence[GpuState]) -> list[GpuSlice]:
    """Slices for `request` on exactly `gpus`, in that order (room is checked by the caller)."""
    if len(gpus) != request.gpus:
        raise NoFit(request, f"needs {request.gpus} GPU(s), not {len(gpus)}")
    for gpu in gpus:
        if not gpu.healthy:
            raise NoFit(request, f"cannot use GPU {gpu.uuid}: it is unhealthy")
        if gpu.device.mig_dynamic:
            raise NoFit(
                request,
                f"cannot move onto GPU {gpu.uuid}: dynamic MIG GPUs take only the instances "
                "the allocator planned",
            )
    slices = []
    for gpu in gpus:
        charge = slice_charge(request, gpu)
        slices.append(
            GpuSlice(
                uuid=gpu.uuid, index=gpu.index, memory_mib=charge.memory_mib, cores=charge.cores
            )
        )
    return slices


def overbooked(
    node: NodeState, before: Mapping[str, Charge], after: Mapping[str, Charge]
) -> list[str]:
    """GPUs of `node` that would hold more than they have if a pod's charges went from
    `before` to `after`."""
    full = []
    for uuid in set(before) | set(after):
        gpu = node.by_uuid.get(uuid)
        if gpu is None:
            full.append(uuid)
            continue
        was, will = before.get(uuid, Charge()), after.get(uuid, Charge())
        used = gpu.used - was + will
        # Newly taken MIG slices must be free of others' instances and of live ones.
        new_slices = will.mig_mask & ~was.mig_mask
        taken = (gpu.used.mig_mask - was.mig_mask) | gpu.mig_live_mask
        if not _within(gpu, used) or new_slices & taken:
            full.append(uuid)
    return sorted(full)
