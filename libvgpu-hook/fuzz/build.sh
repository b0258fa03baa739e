#!/bin/sh
# Builds the fuzzer of the hook's parsers (fuzz/engine.c + fuzz/fuzz_limits.c) with gcc:
# the parsers and the harness with trace-pc coverage, all with ASan and UBSan.
#   build/fuzz/fuzz_limits           the fuzzer
#   build/fuzz/fuzz_limits_planted   the same with a planted bug (the engine's own test)
set -eu
cd "$(dirname "$0")/.."
CC=${CC:-gcc}
OUT=${OUT:-build}/fuzz
mkdir -p "$OUT"
BASE="-std=c11 -D_GNU_SOURCE -g -Wall -Wextra -Werror -Isrc -Ifuzz"
SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
CFLAGS="$BASE -O1 $SANITIZE"
COVERED="src/limits.c src/relay_msg.c fuzz/fuzz_limits.c"
for variant in fuzz_limits fuzz_limits_planted; do
    extra=""
    [ "$variant" = fuzz_limits_planted ] && extra="-DVGPU_FUZZ_PLANTED"
    # The engine itself is neither instrumented nor sanitized: it runs between every input.
    # shellcheck disable=SC2086 # word lists on purpose
    $CC $BASE -O2 -c fuzz/engine.c -o "$OUT/engine.o.$$"
    # shellcheck disable=SC2086
    $CC $CFLAGS $extra -fsanitize-coverage=trace-pc $COVERED "$OUT/engine.o.$$" \
        -o "$OUT/$variant.tmp.$$"
    mv -f "$OUT/$variant.tmp.$$" "$OUT/$variant"
    rm -f "$OUT/engine.o.$$"
done
echo "built $(pwd)/$OUT"
