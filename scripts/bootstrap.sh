# Sourced (with VGPU_EXTRAS=test for the tests) by scripts/up.sh and scripts/test.sh: make .venv with vgpu installed (once per
# change of pyproject.toml) and build the hook. Needs only python3 (>= 3.11) and gcc.
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${VGPU_EXTRAS:-}"
marker=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
installed() {  # $1: a marker left by an install at least as new as pyproject.toml
    [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ]
}
# The test extras hold the plain install: after scripts/test.sh, scripts/up.sh reuses it.
if ! installed "$marker" && ! { [ -z "$EXTRAS" ] && installed .venv/.installed-test; }; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}"
    touch "$marker"
fi
sh libvgpu-hook/build.sh >/dev/null
