#!/bin/sh
# The dashboard's browser tests (tests/browser) drive Debian's Chromium: install it where it is
# missing and this user may (root with apt-get). Best effort: where it cannot be installed,
# those tests skip and say why, and every other test still runs.
# The names tests/browser/conftest.py looks for.
command -v chromium >/dev/null 2>&1 && exit 0
command -v chromium-browser >/dev/null 2>&1 && exit 0
[ -n "${VGPU_CHROMIUM:-}" ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/browser.sh: no chromium and no way to install it; tests/browser will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! timeout 300 apt-get install -y -q chromium >/tmp/vgpu-apt-chromium.log 2>&1; then
    # The package lists of a fresh machine may be missing or stale.
    timeout 120 apt-get update -q >>/tmp/vgpu-apt-chromium.log 2>&1 || true
    timeout 300 apt-get install -y -q chromium >>/tmp/vgpu-apt-chromium.log 2>&1 || {
        echo "scripts/browser.sh: apt-get could not install chromium (see" \
            "/tmp/vgpu-apt-chromium.log); tests/browser will skip" >&2
    }
fi
exit 0
