"""Processes of `vgpu run`: the caller waits, PID 1 of the container supervises the command.

    vgpu run (host)  --fork-->  init (PID 1: own mount, UTS, IPC namespaces)  --exec-->  CMD

Both wait in `sigwaitinfo` with the forwarded signals blocked: a signal sent by a process
(`kill`, si_code <= 0) is passed one hop down; one the terminal sends (Ctrl-C, si_code
SI_KERNEL) already reaches the whole foreground process group, so it is not sent twice. Init
reaps every orphan, as PID 1 must, and exits with the command's status; its exit takes every
process left in the namespace with it. If `vgpu run` dies, init is killed (PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from services.cli.container import cgroup, creds, linux, rootfs
from services.cli.container.spec import ContainerSpec

FORWARDED = {
    signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
}  # fmt: skip
_WAITED = FORWARDED | {signal.SIGCHLD}
EXIT_RUNTIME_FAILED = 125  # vgpu run itself failed (as docker and podman use it)
EXIT_CANNOT_INVOKE = 126
EXIT_NOT_FOUND = 127
CAP_SYS_ADMIN = 21


class NamespacesUnavailable(RuntimeError):
    """This machine or user cannot create the namespaces a container needs."""


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _fail(message: str, code: int = EXIT_RUNTIME_FAILED) -> None:
    print(f"vgpu run: {message}", file=sys.stderr, flush=True)
    os._exit(code)


def _spawn(spec: ContainerSpec, cap_last: int) -> subprocess.Popen[bytes]:
    """The command, started. The caller must keep the Popen alive: a collected Popen reaps
    its child in __del__ if it already exited, and PID 1's wait would never see it."""

    def drop() -> None:
        try:
            creds.drop_to(spec, cap_last)
        except OSError as exc:
            print(f"vgpu run: cannot drop privileges: {exc}", file=sys.stderr, flush=True)
            raise

    try:
        child = subprocess.Popen(spec.argv, env=spec.env, preexec_fn=drop, restore_signals=True)
    except FileNotFoundError:
        _fail(f"{spec.argv[0]}: command not found in the container", EXIT_NOT_FOUND)
    except PermissionError:
        _fail(f"{spec.argv[0]}: permission denied (uid {spec.uid})", EXIT_CANNOT_INVOKE)
    except (OSError, subprocess.SubprocessError) as exc:
        _fail(f"cannot start {spec.argv[0]}: {exc}")
    return child


def _init(spec: ContainerSpec, scratch: str) -> None:
    """PID 1 of the container; never returns."""
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        cap_last = creds.last_capability()
        if spec.cgroup:
            cgroup.join(spec.cgroup)  # before anything is started: children inherit it
        linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWUTS | linux.CLONE_NEWIPC)
        linux.sethostname(spec.hostname[:64])
        rootfs.build(spec, scratch)
    except (OSError, rootfs.RootfsError) as exc:
        _fail(f"cannot set up the container: {exc}")
    command = _spawn(spec, cap_last)  # held until os._exit (see _spawn)
    main = command.pid
    while True:
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo != signal.SIGCHLD:
            if info.si_code <= 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(main, info.si_signo)
            continue
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == main:
                os._exit(_exit_code(status))


def _wait_for(init: int) -> int:
    while True:
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo == signal.SIGCHLD:
            pid, status = os.waitpid(init, os.WNOHANG)
            if pid:
                return _exit_code(status)
        elif info.si_code <= 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, info.si_signo)


def _remove_cgroup(relative: str) -> None:
    hierarchy = cgroup.hierarchy()
    if hierarchy is not None:
        cgroup.remove(os.path.join(hierarchy, relative))


def check_privileges() -> None:
    """Raise NamespacesUnavailable unless this process may make a container's namespaces."""
    status = Path("/proc/self/status").read_text()
    effective = int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), 16
    )
    if os.geteuid() != 0 or not effective & (1 << CAP_SYS_ADMIN):
        raise NamespacesUnavailable(
            "vgpu run needs root with CAP_SYS_ADMIN to create mount and PID namespaces, as a "
            "container runtime does: run it with sudo, and not inside a container"
        )


def run(spec: ContainerSpec) -> int:
    """Run the spec's command in a container; its exit status (128+N if killed by signal N).

    Must be called from a single-threaded process (it forks); raises NamespacesUnavailable
    before anything started when the namespaces cannot be made.
    """
    check_privileges()
    scratch = tempfile.mkdtemp(prefix="vgpu-run-")
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    try:
        try:
            linux.unshare(linux.CLONE_NEWPID)
        except OSError as exc:
            raise NamespacesUnavailable(
                f"cannot create a PID namespace ({exc.strerror}): this machine or sandbox "
                "does not allow namespaces, so vgpu run cannot isolate the command"
            ) from exc
        sys.stdout.flush()
        sys.stderr.flush()
        init = os.fork()
        if init == 0:
            try:
                _init(spec, scratch)
            except BaseException:  # a forked child must never return
                traceback.print_exc()
            finally:
                os._exit(EXIT_RUNTIME_FAILED)
        return _wait_for(init)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if spec.cgroup:
            _remove_cgroup(spec.cgroup)
        with contextlib.suppress(OSError):
            os.rmdir(scratch)
