"""A seccomp filter with the one rule of Docker's default profile that matters here: no new
user namespaces. Without CAP_SYS_ADMIN a process cannot remount or unmount its mounts, but
in a user namespace of its own it could mount a tmpfs over /var/run/vgpu and show the hook a
forged limits file. `clone3` answers ENOSYS (its flags are behind a pointer the filter cannot
read), so libc falls back to `clone`, whose flags it can; other ABIs than the machine's own
(i386, x32) answer ENOSYS too.
"""

from __future__ import annotations

import ctypes
import errno
import os

from services.cli.container import linux

CLONE_NEWUSER = 0x10000000
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# Per machine: audit arch, clone, unshare, clone3.
_ARCH = {"x86_64": (0xC000003E, 56, 272, 435), "aarch64": (0xC00000B7, 220, 97, 435)}
_X32_BIT = 0x40000000
# BPF opcodes: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JSET|BPF_K, BPF_RET|BPF_K
_LD, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06


class _Filter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def program() -> list[tuple[int, int, int, int]]:
    machine = os.uname().machine
    if machine not in _ARCH:
        raise OSError(f"vgpu run has no seccomp filter for this machine ({machine})")
    arch, clone, unshare, clone3 = _ARCH[machine]
    enosys, eperm = _RET_ERRNO | errno.ENOSYS, _RET_ERRNO | errno.EPERM
    allow, deny, absent = 10, 11, 12  # where the three answers sit
    rules = [
        (_LD, 0, 0, 4),  # 0: seccomp_data.arch
        (_JEQ, 1, 0, arch),  # 1: the machine's own ABI goes on to 3
        (_RET, 0, 0, enosys),  # 2
        (_LD, 0, 0, 0),  # 3: seccomp_data.nr
        (_JGE, absent - 5, 0, _X32_BIT),  # 4: x32
        (_JEQ, absent - 6, 0, clone3),  # 5
        (_JEQ, 1, 0, clone),  # 6: to the flags
        (_JEQ, 0, allow - 8, unshare),  # 7: to the flags, else allowed
        (_LD, 0, 0, 16),  # 8: the low word of args[0], the flags
        (_JSET, deny - 10, allow - 10, CLONE_NEWUSER),  # 9
        (_RET, 0, 0, _RET_ALLOW),  # 10
        (_RET, 0, 0, eperm),  # 11
        (_RET, 0, 0, enosys),  # 12
    ]
    return rules


def install() -> None:
    """Install the filter for this thread and what it executes (no_new_privs must be set)."""
    rules = program()
    filters = (_Filter * len(rules))(*[_Filter(*rule) for rule in rules])
    prog = _Program(len(rules), filters)
    linux.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog))
