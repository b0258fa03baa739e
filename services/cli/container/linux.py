"""The Linux system calls `vgpu run` needs that Python 3.11's os module lacks (via libc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _syscall_number(table: dict[str, int]) -> int:
    machine = os.uname().machine
    if machine not in table:
        raise OSError(f"vgpu run does not know this machine's system calls ({machine})")
    return table[machine]


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode(), target.encode(), fstype.encode() if fstype else None,
            ctypes.c_ulong(flags), data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )  # fmt: skip


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    number = _syscall_number(_SYS_PIVOT_ROOT)
    _check(_libc.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")


def sethostname(name: str) -> None:
    encoded = name.encode()
    _check(_libc.sethostname(encoded, ctypes.c_size_t(len(encoded))), "sethostname")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    _check(
        _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                    ctypes.c_ulong(0), ctypes.c_ulong(0)),
        f"prctl({option})",
    )  # fmt: skip


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def capset(effective: int, permitted: int, inheritable: int) -> None:
    """Set this thread's capability sets (bit masks of capability numbers)."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for word in range(2):
        shift = 32 * word
        data[word].effective = (effective >> shift) & 0xFFFFFFFF
        data[word].permitted = (permitted >> shift) & 0xFFFFFFFF
        data[word].inheritable = (inheritable >> shift) & 0xFFFFFFFF
    number = _syscall_number(_SYS_CAPSET)
    _check(_libc.syscall(number, ctypes.byref(header), data), "capset")
