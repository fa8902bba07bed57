#!/usr/bin/env bash
# System packages the test suite needs on a fresh Debian 12 machine (as root; a normal user's run goes through sudo):
# a real Redis server, podman + runc with its Docker-compatible API (for the docker backend), debootstrap
# (to build the runtime image from a local root file system: no registry is reachable), node/npm (the
# official openwhisk npm client and pouchdb-server), gcc (the CUDA shim) and the CUDA headers if present.
set -euo pipefail
if [[ $EUID -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || { echo "setup-test-env: run it as root (no sudo here)" >&2; exit 1; }
  exec sudo -- "$0" "$@"
fi
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in redis-server podman runc debootstrap make gcc libc6-dev binutils; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
# node and npm may come from another source (e.g. NodeSource's nodejs bundles npm): check the commands.
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if ((${#need[@]})); then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# podman on these hosts: crun cannot run (hybrid cgroups) and the default nofile limit is too high.
mkdir -p /etc/containers
if ! grep -qs 'runtime = "runc"' /etc/containers/containers.conf; then
  cat > /etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
fi
echo "test environment ready"
