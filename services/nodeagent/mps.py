"""One MPS control daemon per MPS GPU: started, watched, restarted when it dies, stopped.

Each GPU's daemon runs as `<mps_control> -d` with `CUDA_VISIBLE_DEVICES=<uuid>` and its own
pipe and log directories (<mps_root>/<uuid>/{pipe,log}), which Allocate mounts into that
GPU's client containers (grant.py). The daemon detaches, so it is watched through the pid it
writes in its pipe directory, as NVIDIA's mps-control-daemon does. Its defaults are an equal
share per replica; each client's own share comes from its slice (CUDA_MPS_* in Allocate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge

from services.common.processes import process_alive
from services.common.schemas import GpuDevice
from services.common.tasks import stop_task
from services.nodeagent.grant import mps_dirs

log = logging.getLogger("vgpu.nodeagent")

PID_FILE = "nvidia-cuda-mps-control.pid"
START_TIMEOUT_S = 10.0

DAEMON_UP = Gauge(
    "vgpu_nodeagent_mps_daemon_up", "MPS control daemon running (1) or not (0)", ["node", "gpu"]
)
DAEMON_RESTARTS = Counter(
    "vgpu_nodeagent_mps_daemon_restarts_total",
    "MPS control daemons found dead and started again",
    ["node", "gpu"],
)


class MpsError(RuntimeError):
    pass


@dataclass
class _Daemon:
    gpu: GpuDevice
    pipe: Path
    logs: Path
    pid: int = 0
    restarts: int = 0


class MpsDaemons:
    def __init__(
        self,
        *,
        node_name: str,
        command: str,
        mps_root: str,
        gpus: list[GpuDevice],
        interval_s: float = 1.0,
    ) -> None:
        self._node = node_name
        self._argv = shlex.split(command)
        if not self._argv:
            raise MpsError("mps_control names no program")
        self._daemons = {gpu.uuid: _Daemon(gpu, *mps_dirs(mps_root, gpu.uuid)) for gpu in gpus}
        self._interval_s = interval_s
        self._watch: asyncio.Task[None] | None = None

    def pid(self, gpu_uuid: str) -> int:
        return self._daemons[gpu_uuid].pid

    def restarts(self, gpu_uuid: str) -> int:
        return self._daemons[gpu_uuid].restarts

    def alive(self, gpu_uuid: str) -> bool:
        daemon = self._daemons[gpu_uuid]
        return bool(daemon.pid) and process_alive(daemon.pid)

    def _env(self, daemon: _Daemon) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": daemon.gpu.uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(daemon.logs),
        }

    async def _run(self, daemon: _Daemon, args: list[str], stdin: str = "") -> tuple[int, str]:
        try:
            process = await asyncio.create_subprocess_exec(
                *self._argv,
                *args,
                env=self._env(daemon),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise MpsError(f"cannot run {self._argv[0]}: {exc.strerror}") from exc
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                _, err = await process.communicate(stdin.encode())
        except TimeoutError:
            process.kill()
            await process.wait()
            raise MpsError(f"{self._argv[0]} {' '.join(args)} did not return") from None
        return process.returncode or 0, err.decode(errors="replace").strip()

    async def _launch(self, daemon: _Daemon) -> None:
        fields = {"node": self._node, "gpu": daemon.gpu.uuid, "pipe": str(daemon.pipe)}
        for directory in (daemon.pipe, daemon.logs):
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, 0o755)
        code, err = await self._run(daemon, ["-d"])
        if code != 0:
            raise MpsError(
                f"MPS control daemon for GPU {daemon.gpu.uuid} did not start (exit {code}): {err}"
            )
        try:
            daemon.pid = int((daemon.pipe / PID_FILE).read_text().strip())
        except (OSError, ValueError) as exc:
            raise MpsError(
                f"MPS control daemon for GPU {daemon.gpu.uuid} wrote no pid file in {daemon.pipe}"
            ) from exc
        replicas = max(1, daemon.gpu.replicas)
        # The daemon's defaults: an equal share per replica, as NVIDIA's daemon sets them.
        defaults = (
            f"set_default_active_thread_percentage {100 // replicas}\n"
            f"set_default_device_pinned_mem_limit 0 {daemon.gpu.memory_mib // replicas}M\n"
        )
        code, err = await self._run(daemon, [], stdin=defaults)
        if code != 0:
            log.warning("MPS defaults not set", extra={**fields, "error": err})
        DAEMON_UP.labels(node=self._node, gpu=daemon.gpu.uuid).set(1)
        log.info("MPS control daemon started", extra={**fields, "pid": daemon.pid})

    async def start(self) -> None:
        """Start every daemon (MpsError naming the GPU if one cannot), then watch them."""
        for daemon in self._daemons.values():
            await self._launch(daemon)
        self._watch = asyncio.create_task(self._watch_loop(), name=f"mps-watch-{self._node}")

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            for daemon in self._daemons.values():
                if process_alive(daemon.pid):
                    continue
                DAEMON_UP.labels(node=self._node, gpu=daemon.gpu.uuid).set(0)
                log.warning(
                    "MPS control daemon died; starting it again",
                    extra={"node": self._node, "gpu": daemon.gpu.uuid, "pid": daemon.pid},
                )
                daemon.restarts += 1
                DAEMON_RESTARTS.labels(node=self._node, gpu=daemon.gpu.uuid).inc()
                try:
                    await self._launch(daemon)
                except MpsError as exc:
                    log.error(
                        "MPS control daemon cannot start again",
                        extra={"node": self._node, "gpu": daemon.gpu.uuid, "error": str(exc)},
                    )

    async def stop(self) -> None:
        task, self._watch = self._watch, None
        if task is not None:
            await stop_task(task, "MPS daemon watch", fields={"node": self._node})
        for daemon in self._daemons.values():
            if not daemon.pid or not process_alive(daemon.pid):
                continue
            with contextlib.suppress(MpsError):
                await self._run(daemon, [], stdin="quit\n")
            for _ in range(100):
                if not process_alive(daemon.pid):
                    break
                await asyncio.sleep(0.02)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(daemon.pid, signal.SIGTERM)
            DAEMON_UP.labels(node=self._node, gpu=daemon.gpu.uuid).set(0)
            log.info(
                "MPS control daemon stopped", extra={"node": self._node, "gpu": daemon.gpu.uuid}
            )
