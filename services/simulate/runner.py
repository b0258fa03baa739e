"""Run many replays (policies x seeds), in worker processes when asked."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from services.simulate import paper, through
from services.simulate.replay import ReplayResult, replay
from services.simulate.trace import TraceNode, TracePod, read_nodes, read_pods
from services.simulate.workload import arrivals, gpu_capacity


@dataclass(frozen=True)
class Job:
    nodes: Path
    pods: Path
    policy: str
    seed: int
    demand: float = 1.3
    cpu_pods: str = "least-stranded"
    # vgpu: through vgpu's engine in process; paper: the FGD paper's simulator;
    # through-scheduler: kube-scheduler emulation -> the allocator's extender over HTTP
    method: str = "vgpu"
    scheduler_config: Path | None = None  # through-scheduler: None = deploy/k8s's


def run_job(
    job: Job,
    loaded: tuple[Sequence[TraceNode], Sequence[TracePod]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    nodes, pods = loaded or (read_nodes(job.nodes), read_pods(job.pods))
    if job.method == paper.METHOD:
        return paper.replay(nodes, pods, job.policy, job.seed, job.demand, progress=progress)
    sequence = arrivals(pods, gpu_capacity(nodes), job.demand, job.seed)
    if job.method == through.METHOD:
        config = job.scheduler_config or through.DEPLOY_CONFIG
        return through.replay(
            nodes, sequence, job.policy, job.seed, config_path=config, progress=progress
        )
    return replay(nodes, sequence, job.policy, job.seed, cpu_pods=job.cpu_pods, progress=progress)


def _worker(job: Job) -> ReplayResult:
    return run_job(job)


def _numbered_worker(numbered: tuple[int, Job]) -> tuple[int, ReplayResult]:
    return numbered[0], run_job(numbered[1])


def run_jobs(
    jobs: Sequence[Job],
    workers: int = 1,
    on_done: Callable[[Job, ReplayResult], None] | None = None,
    ordered: bool = True,
) -> list[ReplayResult]:
    """Results in the order of `jobs`; `workers` > 1 runs them in separate processes.
    `on_done` sees each job as it finishes when not `ordered` (long replays: a slow one
    does not hold back the report of those after it), else in the order of `jobs`."""
    results: list[ReplayResult] = []
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            results.append(run_job(job))
            if on_done:
                on_done(job, results[-1])
        return results
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        if not ordered:
            found: dict[int, ReplayResult] = {}
            for number, result in pool.imap_unordered(
                _numbered_worker, enumerate(jobs), chunksize=1
            ):
                found[number] = result
                if on_done:
                    on_done(jobs[number], result)
            return [found[number] for number in range(len(jobs))]
        for job, result in zip(jobs, pool.imap(_worker, jobs), strict=True):
            results.append(result)
            if on_done:
                on_done(job, result)
    return results


class ProgressBar:
    """A one-line bar on a terminal (stderr), silent when it is not one."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self.width = width
        self._shown = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or not total:
            return
        step = done * 100 // total
        if step == self._shown:
            return
        self._shown = step
        filled = self.width * done // total
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label:<14} [{bar}] {done}/{total} pods")
        if done == total:
            self.stream.write("\r" + " " * (self.width + 40) + "\r")
        self.stream.flush()
