#!/usr/bin/env bash
# Build the action runtime images without any container registry.
#
# 1. A Debian bookworm root filesystem with python3 (3.11) and python3-aiohttp (3.8) is made with
#    debootstrap once and cached as a tarball under $DILU_IMAGE_CACHE (CI can keep that directory).
# 2. The runtime's code (dilu_invoker/__init__.py + dilu_invoker/actions/) is appended to a copy of the
#    tarball and the result is imported with `podman import`, once per image name in runtimes.json.
#
# Without a GPU stack in the rootfs the python:3-gpu image is the same CPU image under its own name, so
# GPU-kind actions run (on the CPU) on machines without GPUs; Containerfile.gpu builds the real one.
#
# Environment:
#   DILU_IMAGE_CACHE   cache directory for the rootfs tarball (default: ~/.cache/dilu-invoker/images)
#   DILU_DEBIAN_MIRROR Debian mirror for debootstrap (default: http://deb.debian.org/debian)
#   DILU_IMAGES        image references to build (default: every image in runtimes.json)
#   PODMAN             podman command (default: podman)
# Needs root (debootstrap, podman's storage). Usage: build_local.sh [--rebuild-rootfs]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
actions_dir="$(dirname "$here")"
package_dir="$(dirname "$actions_dir")"
cache_dir="${DILU_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dilu-invoker/images}"
mirror="${DILU_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
podman="${PODMAN:-podman}"
suite=bookworm
packages=python3,python3-aiohttp
rootfs_tar="$cache_dir/rootfs-$suite-$(uname -m)-${packages//,/-}.tar"

log() { printf 'build_local: %s\n' "$*" >&2; }

if [[ "${1:-}" == "--rebuild-rootfs" ]]; then
    rm -f "$rootfs_tar"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/dilu-image-XXXXXX")"
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

if [[ ! -s "$rootfs_tar" ]]; then
    log "debootstrap $suite ($packages) from $mirror"
    mkdir -p "$cache_dir"
    debootstrap --variant=minbase --include="$packages" "$suite" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
        tail -n 30 "$work/debootstrap.log" >&2
        exit 1
    }
    # Package caches and lists are dead weight in the image.
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"* \
        "$work/rootfs/usr/share/doc" "$work/rootfs/usr/share/man" "$work/rootfs/usr/share/info"
    tar -C "$work/rootfs" --numeric-owner -cf "$rootfs_tar.partial" .
    mv "$rootfs_tar.partial" "$rootfs_tar"
    rm -rf "$work/rootfs"
else
    log "reusing cached root filesystem $rootfs_tar"
fi

# The runtime's code goes to /opt/dilu (on PYTHONPATH); nothing else of the project ships.
mkdir -p "$work/layer/opt/dilu/dilu_invoker"
cp "$package_dir/__init__.py" "$work/layer/opt/dilu/dilu_invoker/"
mkdir -p "$work/layer/opt/dilu/dilu_invoker/actions"
tar -C "$actions_dir" --exclude=__pycache__ --exclude='*.pyc' --exclude=./images -cf - . \
    | tar -C "$work/layer/opt/dilu/dilu_invoker/actions" -xf -
mkdir -p "$work/layer/usr/local/lib/dilu"  # bind-mount point of the GPU shim (libdilu_shim.so)

cp "$rootfs_tar" "$work/image.tar"
tar -C "$work/layer" --numeric-owner --owner=0 --group=0 -rf "$work/image.tar" ./opt/dilu ./usr/local/lib/dilu

if [[ -n "${DILU_IMAGES:-}" ]]; then
    images="$DILU_IMAGES"
else
    images="$(python3 - "$actions_dir/runtimes.json" <<'EOF'
import json, sys
manifest = json.load(open(sys.argv[1]))
for family in manifest["runtimes"].values():
    for runtime in family:
        image = runtime["image"]
        prefix = image.get("registry", "") + ("/" if image.get("registry") else "") + image.get("prefix", "")
        print(f"{prefix}/{image['name']}:{image.get('tag', 'latest')}")
EOF
)"
fi

# Images replaced by this build; removed at the end unless something still uses them.
previous=""
for image in $images; do
    previous="$previous $("$podman" image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
done

first=""
for image in $images; do
    if [[ -z "$first" ]]; then
        log "importing $image"
        "$podman" import \
            --change 'ENV PYTHONPATH=/opt/dilu' \
            --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'WORKDIR /' \
            --change 'EXPOSE 8080' \
            --change 'CMD ["python3", "-m", "dilu_invoker.actions.runtime", "--host", "0.0.0.0", "--port", "8080"]' \
            "$work/image.tar" "$image" >/dev/null
        first="$image"
    else
        log "tagging $image"
        "$podman" tag "$first" "$image"
    fi
    printf '%s\n' "$image"
done

for old in $previous; do
    "$podman" rmi "$old" >/dev/null 2>&1 || true
done
