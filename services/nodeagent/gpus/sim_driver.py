"""The simulated CUDA driver's per-process device memory, read as NVML reads the real one.

The simulated driver (libvgpu-hook/sim/sim_procs.h) keeps one table per GPU in
`<state dir>/<uuid>.procs`, shared by every process that uses the simulated GPU. Each process
owns a slot and holds a POSIX record lock on its first byte while it lives; the kernel drops
the lock when the process dies, and F_GETLK names the holder by its PID in the reader's PID
namespace (the host's, for the agent). So this reader lists exactly the live processes, with
host PIDs and what the driver really gave them, whether or not a hook saw the allocations.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x31534F5250534756  # "VGSPROS1"
VERSION = 1
HEADER_BYTES = 64
SLOT_BYTES = 64
_HEADER = struct.Struct("<QII")
# used bytes, pid (own namespace), 0, pid-ns inode, start, GPU time of its kernels (ns)
_SLOT = struct.Struct("<QiIQQQ")
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock on 64-bit Linux
_F_WRLCK = fcntl.F_WRLCK
_F_UNLCK = fcntl.F_UNLCK


@dataclass(frozen=True)
class DriverProcess:
    pid: int  # as this process's PID namespace sees it (host PID for the agent)
    used_bytes: int
    slot: int = -1  # its slot in the table: with pid, names one process's GPU-time counter
    busy_ns: int = 0  # GPU time of the kernels it queued, since it took the slot


def table_path(state_dir: Path, gpu_uuid: str) -> Path:
    return state_dir / f"{gpu_uuid}.procs"


def _holder(fd: int, offset: int) -> int:
    """PID holding the lock on byte `offset`; 0 when nobody (or someone we cannot name)."""
    query = _FLOCK.pack(_F_WRLCK, os.SEEK_SET, offset, 1, 0)
    l_type, _, _, _, l_pid = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, query))
    return l_pid if l_type != _F_UNLCK and l_pid > 0 else 0


def live_processes(state_dir: Path, gpu_uuid: str) -> list[DriverProcess]:
    """The live processes of one simulated GPU; [] when no process ever used it."""
    try:
        fd = os.open(table_path(state_dir, gpu_uuid), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        data = os.pread(fd, 1 << 20, 0)
        if len(data) < HEADER_BYTES:
            return []
        magic, version, slots = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise ValueError(
                f"{table_path(state_dir, gpu_uuid)} is not a simulated driver's process table "
                f"(magic {magic:#x}, version {version})"
            )
        found: list[DriverProcess] = []
        for index in range(min(slots, (len(data) - HEADER_BYTES) // SLOT_BYTES)):
            offset = HEADER_BYTES + index * SLOT_BYTES
            _, own_pid, _, _, _, _ = _SLOT.unpack_from(data, offset)
            if own_pid == 0:
                continue  # never taken
            pid = _holder(fd, offset)
            if pid:  # read after the lock check: a new owner zeroes what a dead one left
                used, _, _, _, _, busy = _SLOT.unpack(os.pread(fd, _SLOT.size, offset))
                found.append(DriverProcess(pid=pid, used_bytes=used, slot=index, busy_ns=busy))
        return found
    finally:
        # Safe: this process never holds locks on the table (only the driver's users do).
        os.close(fd)
