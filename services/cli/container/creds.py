"""Credentials of the container's command: its user, no new privileges, few capabilities."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from services.cli.container import linux, seccomp
from services.cli.container.spec import ContainerSpec


def last_capability() -> int:
    """The highest capability number this kernel knows (read before /proc changes)."""
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 40  # CAP_CHECKPOINT_RESTORE, the highest as of Linux 6.x


def drop_to(spec: ContainerSpec, cap_last: int) -> None:
    """In the forked child, just before exec: after this nothing regains what was dropped.

    The bounding set loses every capability the spec does not keep (so neither exec of a
    setuid binary nor file capabilities can bring one back), no_new_privs is set, ambient and
    inheritable capabilities are cleared, and the user changes last: for a non-root user the
    kernel then clears the remaining permitted and effective sets; for root they are set to
    exactly the kept capabilities. Last, the seccomp filter (no user namespaces).
    """
    keep = spec.capabilities
    # A fresh process: default dispositions (a shell may have ignored SIGINT for a
    # background job) and no blocked signals (the supervisor blocks the ones it forwards).
    for number in signal.valid_signals():
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    for capability in range(cap_last + 1):
        if not keep & (1 << capability):
            linux.prctl(linux.PR_CAPBSET_DROP, capability)
    linux.prctl(linux.PR_CAP_AMBIENT, linux.PR_CAP_AMBIENT_CLEAR_ALL)
    os.setgroups([])
    os.setresgid(spec.gid, spec.gid, spec.gid)
    os.setresuid(spec.uid, spec.uid, spec.uid)
    linux.capset(effective=keep, permitted=keep, inheritable=0)
    seccomp.install()
