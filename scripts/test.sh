#!/bin/sh
# Install what the tests need, build the hook, check style and run every test.
set -eu
VGPU_EXTRAS=test . "$(dirname "$0")/bootstrap.sh"
sh scripts/browser.sh
.venv/bin/ruff format --check .
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
