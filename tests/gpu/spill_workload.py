"""A CUDA driver program for virtual device memory on a real GPU, in plain Python (ctypes on
libcuda.so.1, a PTX kernel the driver compiles): no framework or toolkit needed.

  spill_workload.py hold <MiB>           allocate MiB in 256 MiB chunks, print "held=<MiB>",
                                          keep it until stdin closes
  spill_workload.py touch <MiB>          allocate one MiB buffer, print "allocated managed=<0|1>",
                                          wait for a line on stdin, run the kernel over it once,
                                          print "touched", keep it until stdin closes
  spill_workload.py bench <MiB> <iters>  allocate one MiB buffer (cuMemAlloc_v2), run a kernel
                                          that reads and writes every word of it iters times,
                                          print "result=<rc> managed=<0|1> gbps=<GB/s>"

Under libvgpu-hook with virtual device memory, a buffer the card cannot hold comes back as
managed memory (CU_POINTER_ATTRIBUTE_IS_MANAGED = 1); without it, result is the driver's
CUDA_ERROR_OUT_OF_MEMORY (2).
"""

from __future__ import annotations

import ctypes
import sys
import time

MIB = 1 << 20
CU_POINTER_ATTRIBUTE_IS_MANAGED = 8

# Adds 1 to every 32-bit word of p[0:n], grid-stride.
PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry touch(.param .u64 p, .param .u64 n)
{
  .reg .pred %p<2>;
  .reg .b32 %r<6>;
  .reg .b64 %rd<10>;
  ld.param.u64 %rd1, [p];
  ld.param.u64 %rd2, [n];
  mov.u32 %r1, %ctaid.x;
  mov.u32 %r2, %ntid.x;
  mov.u32 %r3, %tid.x;
  cvt.u64.u32 %rd3, %r1;
  cvt.u64.u32 %rd4, %r2;
  cvt.u64.u32 %rd5, %r3;
  mul.lo.u64 %rd6, %rd3, %rd4;
  add.u64 %rd6, %rd6, %rd5;
  mov.u32 %r4, %nctaid.x;
  cvt.u64.u32 %rd7, %r4;
  mul.lo.u64 %rd7, %rd7, %rd4;
LOOP:
  setp.ge.u64 %p1, %rd6, %rd2;
  @%p1 bra DONE;
  shl.b64 %rd8, %rd6, 2;
  add.u64 %rd9, %rd1, %rd8;
  ld.global.u32 %r5, [%rd9];
  add.u32 %r5, %r5, 1;
  st.global.u32 [%rd9], %r5;
  add.u64 %rd6, %rd6, %rd7;
  bra LOOP;
DONE:
  ret;
}
"""


class Cuda:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ctx = ctypes.c_void_p()
        dev = ctypes.c_int()
        self.ok(self.lib.cuInit(0), "cuInit")
        self.ok(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ok(self.lib.cuCtxCreate_v2(ctypes.byref(self.ctx), 0, dev), "cuCtxCreate")

    @staticmethod
    def ok(rc: int, what: str) -> None:
        if rc != 0:
            raise SystemExit(f"{what} failed: {rc}")

    def alloc(self, nbytes: int) -> tuple[int, int]:
        ptr = ctypes.c_uint64()
        rc = self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return rc, ptr.value

    def managed(self, ptr: int) -> bool:
        flag = ctypes.c_uint()
        self.ok(
            self.lib.cuPointerGetAttribute(
                ctypes.byref(flag), CU_POINTER_ATTRIBUTE_IS_MANAGED, ctypes.c_uint64(ptr)
            ),
            "cuPointerGetAttribute",
        )
        return bool(flag.value)

    def kernel(self) -> ctypes.c_void_p:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.ok(self.lib.cuModuleLoadData(ctypes.byref(module), PTX), "cuModuleLoadData")
        self.ok(
            self.lib.cuModuleGetFunction(ctypes.byref(function), module, b"touch"),
            "cuModuleGetFunction",
        )
        return function

    def touch(self, function: ctypes.c_void_p, ptr: int, words: int) -> None:
        p, n = ctypes.c_uint64(ptr), ctypes.c_uint64(words)
        params = (ctypes.c_void_p * 2)(
            ctypes.cast(ctypes.byref(p), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(n), ctypes.c_void_p),
        )
        self.ok(
            self.lib.cuLaunchKernel(function, 2048, 1, 1, 256, 1, 1, 0, None, params, None),
            "cuLaunchKernel",
        )

    def sync(self) -> None:
        self.ok(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


def hold(mib: int) -> None:
    cuda = Cuda()
    held = 0
    while held + 256 <= mib and cuda.alloc(256 * MIB)[0] == 0:
        held += 256
    print(f"held={held}", flush=True)
    sys.stdin.read()


def bench(mib: int, iterations: int) -> None:
    cuda = Cuda()
    rc, ptr = cuda.alloc(mib * MIB)
    if rc != 0:
        print(f"result={rc} managed=0 gbps=0")
        return
    function = cuda.kernel()
    words = mib * MIB // 4
    cuda.touch(function, ptr, words)  # first touch: pages settle where they will live
    cuda.sync()
    started = time.perf_counter()
    for _ in range(iterations):
        cuda.touch(function, ptr, words)
    cuda.sync()
    seconds = time.perf_counter() - started
    gbps = 2 * mib * MIB * iterations / seconds / 1e9  # each pass reads and writes every word
    print(f"result=0 managed={int(cuda.managed(ptr))} gbps={gbps:.2f}")


def touch_later(mib: int) -> None:
    cuda = Cuda()
    rc, ptr = cuda.alloc(mib * MIB)
    if rc != 0:
        raise SystemExit(f"cuMemAlloc_v2 failed: {rc}")
    print(f"allocated managed={int(cuda.managed(ptr))}", flush=True)
    sys.stdin.readline()
    cuda.touch(cuda.kernel(), ptr, mib * MIB // 4)
    cuda.sync()
    print("touched", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(int(sys.argv[2]))
    elif sys.argv[1] == "touch":
        touch_later(int(sys.argv[2]))
    else:
        bench(int(sys.argv[2]), int(sys.argv[3]))
