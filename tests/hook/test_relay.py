"""The relay client against an agent-side socket speaking PROTOCOL.md: the node agent's own
decoder (services/nodeagent/relay_protocol.py) must accept every line the hook sends, and the
agent's `util` lines must reach the limiter."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from services.nodeagent.relay_protocol import (
    Exit,
    Hello,
    Usage,
    UtilDevice,
    decode_line,
    encode_util,
)
from tests.hook.harness import hook_env, limits_text, summary, tool, write_limits


class Agent:
    """Listens on <dir>/relay.sock, decodes what hooks send, and can send `util`."""

    def __init__(self, container_dir: Path, util: list[UtilDevice] | None = None) -> None:
        self.messages: list[object] = []
        self.util = util
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(container_dir / "relay.sock"))
        self.server.listen(8)
        self.server.settimeout(0.1)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self.talk, args=(conn,), daemon=True).start()

    def talk(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        buf, last_util = b"", 0.0
        with conn:
            while not self.stopping.is_set():
                if self.util and time.monotonic() - last_util > 0.1:
                    conn.sendall(encode_util(self.util))
                    last_util = time.monotonic()
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.messages.append(decode_line(line))  # raises if malformed

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.server.close()


@contextmanager
def agent(container_dir: Path, util: list[UtilDevice] | None = None) -> Iterator[Agent]:
    a = Agent(container_dir, util)
    try:
        yield a
    finally:
        a.stop()


def test_hello_usage_and_exit_reach_the_agent(build: Path, short_dir: Path) -> None:
    write_limits(short_dir, limits_text(1024, cores=40))
    with agent(short_dir) as a:
        proc = subprocess.Popen(
            [tool("mem_paths"), "alloc", "link", "create", "100", "hold"],
            env=hook_env(short_dir, VGPU_HOOK_QUIET="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("holding allocated_mib=1000")
        time.sleep(0.6)  # a couple of reports
        proc.communicate(timeout=30)
        time.sleep(0.3)
    hello = a.messages[0]
    assert isinstance(hello, Hello)
    assert hello.pid == proc.pid and hello.comm == "mem_paths"
    assert [(d.index, d.uuid, d.limit_mib, d.cores) for d in hello.devices] == [
        (0, "GPU-5e4c0000-0000-4000-8000-000000000000", 1024, 40)
    ]
    usages = [m for m in a.messages if isinstance(m, Usage)]
    assert len(usages) >= 2
    holding = [u for u in usages if u.devices[0].process_used_mib == 1000]
    assert holding and holding[0].devices[0].used_mib == 1000
    assert usages == sorted(usages, key=lambda u: u.ts_ms)
    assert isinstance(a.messages[-1], Exit) and a.messages[-1].pid == proc.pid


def test_an_agent_that_never_reads_does_not_stall_the_application(
    build: Path, short_dir: Path
) -> None:
    write_limits(short_dir, limits_text(1024, cores=100))
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deaf.bind(str(short_dir / "relay.sock"))
    deaf.listen(1)  # accepts into the backlog, never reads
    try:
        started = time.monotonic()
        proc = subprocess.run(
            [tool("launch_load"), "1.0", "1"],
            env=hook_env(short_dir, VGPU_HOOK_QUIET="1"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        assert time.monotonic() - started < 5
    finally:
        deaf.close()


def rate(container_dir: Path, **extra: str) -> float:
    proc = subprocess.run(
        [tool("launch_load"), "1.0", "1000"],
        env=hook_env(container_dir, VGPU_HOOK_QUIET="1", **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.split("per_second=")[1])


@pytest.mark.parametrize(("policy", "throttled"), [("share", False), ("hard", True)])
def test_agent_saying_nobody_else_uses_the_gpu_lifts_the_limit_under_share(
    build: Path, short_dir: Path, policy: str, throttled: bool
) -> None:
    write_limits(short_dir, limits_text(1024, cores=30))
    # The whole GPU's utilisation is the container's own: nobody else wants it.
    idle_others = [UtilDevice(index=0, sm_util_percent=30.0, container_sm_util_percent=30.0)]
    with agent(short_dir, idle_others) as a:
        r = rate(short_dir, VGPU_COMPUTE_POLICY=policy)
    usage = [m for m in a.messages if isinstance(m, Usage)][-1]
    print(f"\n{policy}: {r:.0f} launches/s, throttled {usage.throttled_ms} ms")
    if throttled:
        assert r < 500 and usage.throttled_ms > 250
    else:  # never held (a loaded machine may still run it below the GPU's 1000/s)
        assert usage.throttled_ms < 100 and r > 350, (r, usage.throttled_ms)
    assert usage.launches > 0


def test_usage_counts_launches(build: Path, short_dir: Path) -> None:
    write_limits(short_dir, limits_text(1024, cores=100))
    with agent(short_dir) as a:
        proc = subprocess.run(
            [tool("launch_load"), "0.6", "100"],
            env=hook_env(short_dir, VGPU_HOOK_QUIET="1"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        time.sleep(0.2)
    launched = summary(proc)["launches"]
    usages = [m for m in a.messages if isinstance(m, Usage)]
    assert usages and 0 < usages[-1].launches <= launched
