"""Allocate device memory behind the hook's back, as a hostile tenant could (docs/security.md).

    bypass-hook.py MIB [SECONDS]

Loads the CUDA driver into a fresh link-map namespace (dlmopen), where no preloaded library
reaches, allocates MIB MiB there, prints `allocated <CUresult>` and holds it for SECONDS
(default 60). The hook never sees the call; the node agent's per-process measurement does.
"""

import ctypes
import sys
import time

LM_ID_NEWLM, RTLD_NOW = -1, 2
mib = int(sys.argv[1])
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
libc = ctypes.CDLL(None)
libc.dlmopen.restype = ctypes.c_void_p
libc.dlmopen.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
handle = libc.dlmopen(LM_ID_NEWLM, b"libcuda.so.1", RTLD_NOW)
if not handle:
    sys.exit("bypass-hook: no libcuda.so.1 on the library path")
cuda = ctypes.CDLL("libcuda.so.1", handle=handle)
device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
assert cuda.cuCtxSetCurrent(context) == 0
result = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib << 20))
print("allocated", result, flush=True)
time.sleep(seconds)
