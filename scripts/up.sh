#!/bin/sh
# Install vgpu into .venv (first run only) and run the whole system locally: `vgpu up`.
set -eu
. "$(dirname "$0")/bootstrap.sh"
exec .venv/bin/vgpu up "$@"
