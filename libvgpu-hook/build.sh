#!/bin/sh
# Builds libvgpu-hook with gcc and sh only; the single source of truth for how
# it is built (the Makefile just calls this). Everything lands in build/:
#   build/libvgpu.so            the hook, LD_PRELOADed into GPU containers
#   build/sim/libcuda.so.1      simulated CUDA driver (+ libcuda.so symlink)
#   build/tests/                test programs (run by tests/hook/test_hook.py)
#
# Environment: CC (default gcc), SANITIZE=1 adds -fsanitize=address,undefined.
set -eu

cd "$(dirname "$0")"
CC=${CC:-gcc}
OUT=build
CFLAGS="-std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -fPIC -fvisibility=hidden -Iinclude"
if [ "${SANITIZE:-0}" = 1 ]; then
    CFLAGS="$CFLAGS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
fi
SHARED="-shared -Wl,--no-undefined"

run() {
    echo "  $*"
    "$@"
}

mkdir -p "$OUT/sim" "$OUT/tests"

# shellcheck disable=SC2086 # CFLAGS and friends are word lists on purpose
run $CC $CFLAGS $SHARED -Wl,-soname,libvgpu.so -o "$OUT/libvgpu.so" \
    src/hook.c src/real_cuda.c src/loader.c src/limits.c src/accounting.c src/log.c \
    -ldl -pthread

# shellcheck disable=SC2086
run $CC $CFLAGS $SHARED -Wl,-soname,libcuda.so.1 -o "$OUT/sim/libcuda.so.1" sim/sim_cuda.c -pthread
ln -sf libcuda.so.1 "$OUT/sim/libcuda.so"

# shellcheck disable=SC2086
run $CC $CFLAGS -o "$OUT/tests/alloc_limit" tests/alloc_limit.c \
    -L"$OUT/sim" -lcuda -Wl,-rpath,'$ORIGIN/../sim' -pthread
# shellcheck disable=SC2086
run $CC $CFLAGS -Isrc -o "$OUT/tests/limits_parse" tests/limits_parse.c src/limits.c
# shellcheck disable=SC2086
run $CC $CFLAGS -Isrc -o "$OUT/tests/accounting_test" tests/accounting_test.c src/accounting.c \
    -pthread

echo "built $(pwd)/$OUT"
