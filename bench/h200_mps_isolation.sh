#!/usr/bin/env bash
# Diagnosis on a GPU machine (root): can isolated process containers share one GPU through MPS?
#
# An MPS control daemon runs one uid's server at a time, so isolated containers that are MPS clients of
# one GPU share a uid, and a private PID namespace with its own /proc (plus the sandbox's mount view) keeps
# them apart instead. This checks, with the same tools the process backend uses (util-linux `unshare` and
# `setpriv`), that torch clients in separate PID namespaces under one uid are served by one MPS server at
# once, and what a private /dev/shm does to a client. Writes OUT/mps_isolation.txt and .json.
#
#   bash bench/h200_mps_isolation.sh OUT
set -u
OUT=${1:?usage: h200_mps_isolation.sh OUT}
mkdir -p "$OUT"
exec > >(tee "$OUT/mps_isolation.txt") 2>&1
PY=${PYTHON:-python3}
UID_A=${UID_A:-200777}
ROOT=$(mktemp -d /tmp/dilu-mps-iso.XXXXXX)
chmod 0711 "$ROOT"
PIPE=$ROOT/pipe LOGD=$ROOT/log
mkdir -p "$PIPE" "$LOGD"
chown "$UID_A:$UID_A" "$PIPE" "$LOGD"
chmod 0700 "$PIPE" "$LOGD"
CTL=$(command -v nvidia-cuda-mps-control || echo /usr/bin/nvidia-cuda-mps-control)
echo "== tools"
# Diagnosis only: let the unprivileged uid traverse to the interpreter and torch (the backend binds them in).
for f in "$(readlink -f "$(command -v "$PY")")" "$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"; do
  d=$(dirname "$f"); echo "needs: $f"
  while [ "$d" != / ]; do [ -x "$d" ] && [ $(( 0$(stat -c %a "$d") & 1 )) -eq 1 ] || chmod o+x "$d"; d=$(dirname "$d"); done
done
unshare --version; setpriv --version; "$CTL" -h 2>&1 | head -20
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv
cat > "$ROOT/client.py" <<'EOF'
import json, os, sys, time
t0 = time.time()
import torch
x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
ready = time.time()
n = 0
while time.time() - ready < float(sys.argv[2]):
    for _ in range(10):
        y = x @ x
    torch.cuda.synchronize()
    n += 10
print(json.dumps({"name": sys.argv[1], "uid": os.getuid(), "pid_in_ns": os.getpid(), "ready_s": round(ready - t0, 3),
                  "matmuls_per_s": round(n / (time.time() - ready), 1), "procs_visible": len([p for p in os.listdir("/proc") if p.isdigit()]),
                  "shm": sorted(os.listdir("/dev/shm"))[:5]}), flush=True)
EOF
chmod 0644 "$ROOT/client.py"
export CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD
"$CTL" -d && echo "daemon started"
sleep 1
# A client as the backend starts one: own PID namespace and /proc, one uid, no privileges left.
client() {  # NAME SECONDS [extra unshare args...]
  local name=$1 secs=$2; shift 2
  unshare --pid --fork --kill-child --mount-proc "$@" \
    setpriv --reuid="$UID_A" --regid="$UID_A" --clear-groups --no-new-privs --pdeathsig KILL \
    env HOME="$ROOT" "$PY" "$ROOT/client.py" "$name" "$secs"
}
servers() { echo get_server_list | "$CTL"; for s in $(echo get_server_list | "$CTL"); do echo "clients of $s:"; echo "get_client_list $s" | "$CTL"; done; }
echo "== A alone"
client A 4
echo "== A and B at once (same uid, separate PID namespaces)"
client A 6 & PA=$!
client B 6 & PB=$!
sleep 4; servers
wait $PA $PB
echo "== C with a private /dev/shm (tmpfs in its own mount namespace) beside A"
client A 6 & PA=$!
sleep 1
unshare --mount sh -c "mount -t tmpfs -o mode=1777,size=64m tmpfs /dev/shm && exec unshare --pid --fork --kill-child --mount-proc setpriv --reuid=$UID_A --regid=$UID_A --clear-groups --no-new-privs env HOME=$ROOT timeout 30 $PY $ROOT/client.py C 4" & PC=$!
sleep 3; servers
wait $PA; wait $PC; echo "C exit $?"
echo "== D as the process backend starts an MPS client: private /tmp and /dev/shm, the pipe and log dirs bound read-only"
client A 6 & PA=$!
sleep 1
unshare --mount sh -c "mount --make-rprivate / && mount --bind $PIPE $PIPE && mount -o remount,bind,ro $PIPE && mount --bind $LOGD $LOGD && mount -o remount,bind,ro $LOGD && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec unshare --pid --fork --kill-child --mount-proc setpriv --reuid=$UID_A --regid=$UID_A --clear-groups --no-new-privs env HOME=$ROOT timeout 30 $PY $ROOT/client.py D 4" & PD=$!
sleep 3.5; servers
wait $PA; wait $PD; echo "D exit $?"
echo "== server log"
tail -n 30 "$LOGD/server.log" 2>/dev/null; tail -n 30 "$LOGD/control.log" 2>/dev/null
echo quit | "$CTL"
sleep 1
rm -rf "$ROOT"
echo "== done"
