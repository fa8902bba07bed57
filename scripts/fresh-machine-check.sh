#!/usr/bin/env bash
# The README's set-up commands on a fresh Debian 12, as a normal user, the way a newcomer runs them.
#
# A Debian bookworm root file system (debootstrap minbase + python3, ca-certificates, sudo: what a
# fresh Debian 12 install has that matters here; no python3-venv, no pip, no redis-server) gets a normal
# user `newcomer` (sudo without password, as a machine's first user has) and a copy of this checkout in
# ~/dilu-invoker. In a chroot, as that user:
#
#   1. the README's first command (install + start standalone), run verbatim; the check waits for the API
#      on 127.0.0.1:3233, creates the README's hello action and invokes it blocking, and reports the time
#      from the command's start to that first successful invoke;
#   2. with --tests PATHS: the README's second command, verbatim, with TESTS=PATHS in the environment
#      (the Makefile's `make test` runs only those; the whole suite is what .ci/run runs outside).
#
# The bootstrapped file system is cached as a tarball (default .cache/fresh-machine/, git-ignored); every
# run unpacks a fresh copy. Needs root (debootstrap, chroot, mounts; a normal user's run goes through
# sudo), network access to Debian's and PyPI's package servers, and 127.0.0.1:3233 free.
#
# The last run's logs (first.log, second.log) are kept in the cache dir.
# Environment: DILU_FRESH_CACHE (cache dir), DILU_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# DILU_FRESH_TIMEOUT_S (bound of each command, default 300), DILU_FRESH_REPORT (append a result line).
# Usage: scripts/fresh-machine-check.sh [--tests "tests/test_cli.py ..."] [--rebuild-rootfs]
set -euo pipefail
if [[ $EUID -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || { echo "fresh-machine-check: run it as root" >&2; exit 1; }
  exec sudo --preserve-env=DILU_FRESH_CACHE,DILU_DEBIAN_MIRROR,DILU_FRESH_TIMEOUT_S,DILU_FRESH_REPORT,PIP_CERT -- "$0" "$@"
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${DILU_FRESH_CACHE:-$repo/.cache/fresh-machine}"
mirror="${DILU_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
limit="${DILU_FRESH_TIMEOUT_S:-300}"
packages=python3,ca-certificates,sudo
tarball="$cache/bookworm-$(uname -m)-${packages//,/-}.tar"
user=newcomer
tests=""
while (($#)); do
  case "$1" in
    --tests) tests="$2"; shift 2 ;;
    --rebuild-rootfs) rm -f "$tarball"; shift ;;
    *) echo "usage: $0 [--tests PATHS] [--rebuild-rootfs]" >&2; exit 2 ;;
  esac
done
t_start=$(date +%s.%N)
log() { printf 'fresh-machine-check: [%6.1f s] %s\n' "$(python3 -c "import sys,time; print(time.time()-float(sys.argv[1]))" "$t_start")" "$*" >&2; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

work="$(mktemp -d "${TMPDIR:-/tmp}/dilu-fresh-XXXXXX")"
rootfs="$work/rootfs"
mounted=()

in_rootfs_pids() {
  local p
  for p in /proc/[0-9]*; do
    [[ "$(readlink "$p/root" 2>/dev/null)" == "$rootfs" ]] && echo "${p#/proc/}"
  done
  return 0
}
stop_rootfs_processes() {
  local pids
  pids="$(in_rootfs_pids)"
  [[ -z "$pids" ]] && return 0
  # shellcheck disable=SC2086
  kill -INT $pids 2>/dev/null || true
  for _ in $(seq 1 100); do
    [[ -z "$(in_rootfs_pids)" ]] && return 0
    sleep 0.1
  done
  pids="$(in_rootfs_pids)"
  # shellcheck disable=SC2086
  [[ -n "$pids" ]] && kill -KILL $pids 2>/dev/null || true
  sleep 0.2
}
cleanup() {
  stop_rootfs_processes
  local i
  for ((i=${#mounted[@]}-1; i>=0; i--)); do
    umount "${mounted[$i]}" 2>/dev/null || umount -l "${mounted[$i]}" 2>/dev/null || true
  done
  # the last run's logs stay beside the cache, for a look after a failure
  mkdir -p "$cache" && cp "$work"/*.log "$cache/" 2>/dev/null || true
  if grep -qF " $rootfs" /proc/mounts; then
    log "left $work in place: something is still mounted under it"
    return
  fi
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

python3 - <<'EOF' || { log "127.0.0.1:3233 is in use: the README's server needs it"; exit 1; }
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 3233))
EOF

t_root=$(now)
if [[ ! -s "$tarball" ]]; then
  log "debootstrap bookworm ($packages) from $mirror"
  mkdir -p "$cache"
  debootstrap --variant=minbase --include="$packages" bookworm "$work/bootstrap" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
  rm -rf "$work/bootstrap/var/cache/apt/archives/"*.deb
  tar -C "$work/bootstrap" --numeric-owner -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"
  rm -rf "$work/bootstrap"
fi
mkdir -p "$rootfs"
# in memory: unpacking and removing a few hundred MB of small files on a loaded disk took longer than the
# check itself
mount -t tmpfs -o size=6g,mode=0755 tmpfs "$rootfs"
mounted+=("$rootfs")
tar -C "$rootfs" --numeric-owner -xf "$tarball"
# The host's network settings carry over (a machine on this network has them too): name resolution,
# and where TLS goes through an inspecting proxy, the host's CA bundle and pip's `cert` setting.
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
cp /etc/hosts "$rootfs/etc/hosts"
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
pip_cert="${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}"
if [[ -n "$pip_cert" && -f "$pip_cert" ]]; then
  cp "$pip_cert" "$rootfs/etc/ssl/certs/host-pip-ca.crt"
  printf '[global]\ncert = /etc/ssl/certs/host-pip-ca.crt\n' > "$rootfs/etc/pip.conf"
fi
chroot "$rootfs" useradd --create-home --shell /bin/bash "$user"
echo "$user ALL=(ALL) NOPASSWD:ALL" > "$rootfs/etc/sudoers.d/$user"
chmod 0440 "$rootfs/etc/sudoers.d/$user"
home="$rootfs/home/$user"
mkdir -p "$home/dilu-invoker"
# what a checkout holds: tracked files and untracked ones git does not ignore
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
  | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -C "$home/dilu-invoker" -xf -
chroot "$rootfs" chown -R "$user:$user" "/home/$user"
log "root file system: $(du -sh "$rootfs" | cut -f1)"
for m in proc sys dev dev/pts; do
  mkdir -p "$rootfs/$m"
  case "$m" in
    proc) mount -t proc proc "$rootfs/proc" ;;
    sys) mount -t sysfs sysfs "$rootfs/sys" ;;
    *) mount --bind "/$m" "$rootfs/$m" ;;
  esac
  mounted+=("$rootfs/$m")
done
log "fresh root file system ready in $(since "$t_root") s"

as_user() { chroot "$rootfs" runuser -u "$user" -- bash -lc "cd ~/dilu-invoker && $1"; }

# 1. install + start, then the first blocking invoke
first="$(python3 "$repo/scripts/doc_examples.py" --setup-command 1)"
log "as $user: $first"
t0=$(now)
as_user "$first" >"$work/first.log" 2>&1 &
runner=$!
if ! python3 - "$limit" "$runner" <<'EOF'
import base64, json, os, sys, time, urllib.error, urllib.request
limit, runner = float(sys.argv[1]), int(sys.argv[2])
key = "23bc46b1-71f6-4ed5-8c54-816aa4f8c502:123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP"
auth = {"Authorization": "Basic " + base64.b64encode(key.encode()).decode(), "Content-Type": "application/json"}
api = "http://127.0.0.1:3233/api/v1"
code = 'def main(args):\n    return {"greeting": "Hello " + args.get("name", "world")}\n'
start = time.monotonic()
def call(method, path, body=None):
    req = urllib.request.Request(api + path, method=method, headers=auth,
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, json.load(resp)
ready = None
while time.monotonic() - start < limit:
    try:
        with open(f"/proc/{runner}/stat") as f:
            exited = f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        exited = True
    if exited:
        sys.exit("the first command exited before the API answered")
    try:
        urllib.request.urlopen(api, timeout=1).close()
        ready = time.monotonic() - start
        break
    except OSError:
        time.sleep(0.2)
if ready is None:
    sys.exit(f"the API did not answer within {limit:.0f} s")
print(f"api-ready-s={ready:.1f}", flush=True)
call("PUT", "/namespaces/_/actions/hello?overwrite=true", {"exec": {"kind": "python:3-gpu", "code": code}})
status, result = call("POST", "/namespaces/_/actions/hello?blocking=true&result=true", {"name": "fresh"})
assert (status, result) == (200, {"greeting": "Hello fresh"}), (status, result)
print(f"first-invoke-s={time.monotonic() - start:.1f}", flush=True)
EOF
then
  log "FAILED: the first command's output:"
  tail -n 40 "$work/first.log" >&2
  exit 1
fi >"$work/probe.txt"
cat "$work/probe.txt" >&2
first_invoke=$(sed -n 's/^first-invoke-s=//p' "$work/probe.txt")
ready=$(sed -n 's/^api-ready-s=//p' "$work/probe.txt")
grep -q "installed: " "$work/first.log" || { log "FAILED: install.py did not report its install"; cat "$work/first.log" >&2; exit 1; }
venv_mb=$(du -sm "$home/.local/share/dilu-invoker/venv" | cut -f1)
stop_rootfs_processes
wait "$runner" || { log "FAILED: the server did not stop cleanly"; tail -n 20 "$work/first.log" >&2; exit 1; }
log "first command: API ready after ${ready} s, first blocking invoke answered after ${first_invoke} s (venv ${venv_mb} MB)"
result="first-invoke-s=$first_invoke api-ready-s=$ready venv-mb=$venv_mb"

# 2. the tests command, on the same fresh machine
if [[ -n "$tests" ]]; then
  second="$(python3 "$repo/scripts/doc_examples.py" --setup-command 2)"
  log "as $user: TESTS='$tests' $second"
  t1=$(now)
  if ! TESTS="$tests" timeout "$limit" chroot "$rootfs" runuser -u "$user" -w TESTS -- bash -lc \
      "cd ~/dilu-invoker && $second" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done \
      >"$work/second.log"; then
    log "FAILED: the tests command's output:"
    tail -n 40 "$work/second.log" >&2
    exit 1
  fi
  tail -n 1 "$work/second.log" >&2
  log "tests command passed in $(since "$t1") s"
  result="$result tests-s=$(since "$t1")"
fi
[[ -n "${DILU_FRESH_REPORT:-}" ]] && echo "$(date -u +%FT%TZ) $result" >> "$DILU_FRESH_REPORT"
log "passed: $result"
