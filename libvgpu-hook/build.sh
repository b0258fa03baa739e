#!/bin/sh
# Builds libvgpu-hook with gcc and sh only; the single source of truth for how
# it is built (the Makefile just calls this). Everything lands in build/:
#   build/libvgpu.so                 the hook, LD_PRELOADed into GPU containers
#   build/sim/libcuda.so.1           simulated CUDA driver (+ libcuda.so symlink)
#   build/sim/libnvidia-ml.so.1      simulated NVML (+ libnvidia-ml.so symlink)
#   build/tests/                     test programs (run by tests/hook/)
#
# Environment: CC (default gcc), SANITIZE=1 adds -fsanitize=address,undefined,
# OUT (default build) where to put it all.
set -eu

cd "$(dirname "$0")"
CC=${CC:-gcc}
OUT=${OUT:-build}
CFLAGS="-std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -fPIC -fvisibility=hidden -Iinclude"
if [ "${SANITIZE:-0}" = 1 ]; then
    CFLAGS="$CFLAGS -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
fi
# -Bsymbolic: a library's references to its own functions never go to an
# interposer (the real libcuda behaves so; the hook hands out its own functions).
SHARED="-shared -Wl,--no-undefined -Wl,-Bsymbolic"

run() {
    echo "  $*"
    "$@"
}

# cc OUTPUT ARGS...: compiles to a temporary name, then renames it into place,
# so that a program or library in use (another test run in the same tree) is
# never seen half-written.
cc() {
    out=$1
    shift
    # shellcheck disable=SC2086 # CFLAGS is a word list on purpose
    run $CC $CFLAGS "$@" -o "$out.tmp.$$" && mv -f "$out.tmp.$$" "$out"
}

mkdir -p "$OUT/sim" "$OUT/tests"

HOOK_SOURCES="src/functions.c src/interpose.c src/state.c src/config.c src/limits.c src/region.c
    src/track.c src/memory.c src/pool.c src/vmm.c src/graph_memory.c src/context.c src/procaddr.c src/launch.c src/limiter.c src/relay.c
    src/relay_msg.c src/nvml.c src/log.c src/fork.c src/liveness.c"

# Independent compilations run in parallel; `wait` collects them.
pids=""
# shellcheck disable=SC2086 # SHARED and the source lists are word lists on purpose
cc "$OUT/libvgpu.so" $SHARED -Wl,-soname,libvgpu.so $HOOK_SOURCES -ldl -pthread &
pids="$pids $!"
# shellcheck disable=SC2086
cc "$OUT/sim/libcuda.so.1" $SHARED -Wl,-soname,libcuda.so.1 \
    sim/sim_config.c sim/sim_procs.c sim/sim_cuda.c sim/sim_exec.c sim/sim_reserve.c sim/sim_procaddr.c -pthread &
pids="$pids $!"
# shellcheck disable=SC2086
cc "$OUT/sim/libnvidia-ml.so.1" $SHARED -Wl,-soname,libnvidia-ml.so.1 \
    sim/sim_config.c sim/sim_procs.c sim/sim_nvml.c -pthread &
pids="$pids $!"
for pid in $pids; do wait "$pid" || exit 1; done
ln -sf libcuda.so.1 "$OUT/sim/libcuda.so"
ln -sf libnvidia-ml.so.1 "$OUT/sim/libnvidia-ml.so"

# Programs that use the driver link the simulated one (tests point
# LD_LIBRARY_PATH at it too, as a container's libraries would be found).
LINK_SIM="-L$OUT/sim -lcuda -Wl,-rpath,\$ORIGIN/../sim -pthread"
pids=""
for prog in alloc_limit mem_paths mem_life launch_load fork_race; do
    # shellcheck disable=SC2086
    cc "$OUT/tests/$prog" "tests/$prog.c" $LINK_SIM -ldl &
    pids="$pids $!"
done
# shellcheck disable=SC2086
cc "$OUT/tests/nvml_query" tests/nvml_query.c -ldl &
pids="$pids $!"
# shellcheck disable=SC2086
cc "$OUT/tests/nvml_procs" tests/nvml_procs.c -ldl &
pids="$pids $!"
# Loader and fork safety reproducers (tests/hook/test_loader_fork.py).
# shellcheck disable=SC2086
cc "$OUT/tests/libdl_race_plugin.so" -shared tests/dl_race_plugin.c -ldl &
pids="$pids $!"
# shellcheck disable=SC2086
cc "$OUT/tests/dl_race" tests/dl_race.c -ldl -pthread &
pids="$pids $!"
# Unit tests of the policy code, without interception.
# shellcheck disable=SC2086
cc "$OUT/tests/limits_parse" -Isrc tests/limits_parse.c src/limits.c &
pids="$pids $!"
# shellcheck disable=SC2086
cc "$OUT/tests/track_test" -Isrc tests/track_test.c src/track.c -pthread &
pids="$pids $!"
# shellcheck disable=SC2086
cc "$OUT/tests/region_test" -Isrc tests/region_test.c src/region.c src/liveness.c src/log.c \
    -pthread &
pids="$pids $!"
# shellcheck disable=SC2086
cc "$OUT/tests/policy_test" -Isrc tests/policy_test.c src/limiter.c src/relay_msg.c -pthread &
pids="$pids $!"
for pid in $pids; do wait "$pid" || exit 1; done

echo "built $(pwd)/$OUT"
