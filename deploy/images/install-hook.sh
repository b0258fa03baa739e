#!/bin/sh
# Installs the vgpu hook on a node (the node agent's init container runs this):
#   $VGPU_HOOK_DIR/libvgpu.so                 the hook, mounted into GPU containers
#   $VGPU_CONTAINER_ROOT/ld.so.preload        mounted over /etc/ld.so.preload in them
# Each file is replaced atomically (written beside, then renamed) and only when it changed,
# so containers that already mapped the old library keep it intact. The node's own
# /etc/ld.so.preload is never touched: refusing that is the one check that matters most.
set -eu

SOURCE=${VGPU_HOOK_SOURCE:-/opt/vgpu/libvgpu.so}
HOOK_DIR=${VGPU_HOOK_DIR:-/usr/local/vgpu}
CONTAINER_ROOT=${VGPU_CONTAINER_ROOT:-/var/lib/vgpu/containers}
# Where GPU containers see the hook (the node agent mounts it there).
IN_CONTAINER=/usr/local/vgpu/libvgpu.so

fail() {
    echo "install-hook: $*" >&2
    exit 1
}

# install_file SOURCE DESTINATION MODE: atomic replace when the content differs.
install_file() {
    if [ -f "$2" ] && cmp -s "$1" "$2"; then
        echo "install-hook: $2 is up to date"
        return 0
    fi
    tmp="$2.tmp.$$"
    cp "$1" "$tmp"
    chmod "$3" "$tmp"
    mv -f "$tmp" "$2"
    echo "install-hook: installed $2"
}

[ -s "$SOURCE" ] || fail "no hook library at $SOURCE"
for dir in "$HOOK_DIR" "$CONTAINER_ROOT"; do
    case "$dir" in
        /*) ;;
        *) fail "$dir must be an absolute path" ;;
    esac
    case "$dir" in
        /etc | /etc/*) fail "refusing to write under $dir: that is the node's configuration" ;;
    esac
done
mkdir -p "$HOOK_DIR" "$CONTAINER_ROOT"

install_file "$SOURCE" "$HOOK_DIR/libvgpu.so" 0755

preload="$CONTAINER_ROOT/ld.so.preload.new.$$"
echo "$IN_CONTAINER" > "$preload"
install_file "$preload" "$CONTAINER_ROOT/ld.so.preload" 0644
rm -f "$preload"
