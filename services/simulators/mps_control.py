"""A stand-in for `nvidia-cuda-mps-control` on machines without GPUs: what vgpu's node agent
needs of the real program, with the same command line and environment.

`mps_control -d` starts a control daemon in the background and returns: the daemon uses
`CUDA_MPS_PIPE_DIRECTORY` (its `control` FIFO and pid file) and `CUDA_MPS_LOG_DIRECTORY`
(`control.log`), refuses to start twice on one pipe directory, and runs until told `quit`.
Without `-d` it is the client: each line of stdin is sent to the daemon (`quit`,
`set_default_active_thread_percentage 25`, `set_default_device_pinned_mem_limit 0 1024M`,
`get_server_list`); with no daemon it fails as the real one does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from pathlib import Path

from services.common.processes import process_alive

DEFAULT_PIPE = "/tmp/nvidia-mps"
DEFAULT_LOG = "/var/log/nvidia-mps"
CONTROL = "control"
PID_FILE = "nvidia-cuda-mps-control.pid"
COMMANDS = (
    "quit",
    "get_server_list",
    "set_default_active_thread_percentage",
    "set_default_device_pinned_mem_limit",
)


def _dirs() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE)
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG)
    return pipe, logs


def running_pid(pipe: Path) -> int | None:
    """The daemon's pid when one runs on this pipe directory."""
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if process_alive(pid) else None


def _log(logs: Path, message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(logs / "control.log", "a") as out:
        out.write(f"[{stamp}] {message}\n")


def _prepare(pipe: Path, logs: Path) -> Path:
    fifo = pipe / CONTROL
    with contextlib.suppress(FileNotFoundError):
        fifo.unlink()
    os.mkfifo(fifo, 0o600)
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    _log(logs, f"Control daemon started (devices {visible})")
    return fifo


def _serve(pipe: Path, logs: Path, fifo: Path) -> None:
    try:
        while True:
            with open(fifo) as commands:  # blocks until a client writes
                for line in commands:
                    command = line.strip()
                    if not command:
                        continue
                    if command.split()[0] not in COMMANDS:
                        _log(logs, f"Unknown command: {command}")
                        continue
                    _log(logs, f"Command: {command}")
                    if command == "quit":
                        _log(logs, "Control daemon exited")
                        return
    finally:
        for name in (CONTROL, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (pipe / name).unlink()


def _daemon() -> int:
    pipe, logs = _dirs()
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    if running_pid(pipe) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    ready_r, ready_w = os.pipe()
    if os.fork():  # the caller returns once the daemon is ready, as `-d` does
        os.close(ready_w)
        with os.fdopen(ready_r) as ready:
            return 0 if ready.read() == "ok" else 1
    os.close(ready_r)
    os.setsid()
    if os.fork():
        os._exit(0)  # the daemon is not a child of the caller
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        fifo = _prepare(pipe, logs)
        os.write(ready_w, b"ok")
        os.close(ready_w)
        _serve(pipe, logs, fifo)
    finally:
        os._exit(0)


def _client() -> int:
    pipe, _ = _dirs()
    if running_pid(pipe) is None:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    try:
        fd = os.open(pipe / CONTROL, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENOENT):
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        raise
    with os.fdopen(fd, "w") as control:
        for line in sys.stdin:
            control.write(line if line.endswith("\n") else line + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["-d"]:
        return _daemon()
    if args:
        print(f"usage: {Path(sys.argv[0]).name} [-d]", file=sys.stderr)
        return 2
    return _client()


if __name__ == "__main__":
    sys.exit(main())
