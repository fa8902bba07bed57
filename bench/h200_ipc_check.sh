#!/usr/bin/env bash
# Diagnosis on a GPU machine (root): does CUDA IPC (cuIpcGetMemHandle / cuIpcOpenMemHandle, what the models
# API shares weights with) work between two processes under MPS, and between two PID namespaces?
# Four cases: no MPS / MPS, times one PID namespace / one each (as the process backend's MPS clients run).
#   bash bench/h200_ipc_check.sh OUT
#   ONLY_PIDS=1 bash bench/h200_ipc_check.sh OUT   (exporter and mapper with the same PID in their namespaces,
#                                                   and with the sandbox's distinct PID ranges)
set -u
OUT=${1:?usage: h200_ipc_check.sh OUT}
mkdir -p "$OUT"
exec > >(tee "$OUT/ipc_check.txt") 2>&1
PY=${PYTHON:-python3}
U=${UID_A:-200778}
ROOT=$(mktemp -d /tmp/dilu-ipc.XXXXXX); chmod 0711 "$ROOT"
PIPE=$ROOT/pipe LOGD=$ROOT/log; mkdir -p "$PIPE" "$LOGD"; chown "$U:$U" "$PIPE" "$LOGD" "$ROOT"
for f in "$(readlink -f "$(command -v "$PY")")" "$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"; do
  d=$(dirname "$f"); while [ "$d" != / ]; do chmod o+x "$d" 2>/dev/null; d=$(dirname "$d"); done
done
cat > "$ROOT/ipc.py" <<'EOF'
import ctypes, json, os, sys, time
import torch
role, hfile = sys.argv[1], sys.argv[2]
lib = ctypes.CDLL("libcuda.so.1")
class H(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
x = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
if role == "holder":
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(x.data_ptr()))
    h = H()
    rc = lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(base.value))
    open(hfile + ".tmp", "wb").write(ctypes.string_at(ctypes.addressof(h), 64)); os.rename(hfile + ".tmp", hfile)
    print(json.dumps({"role": role, "export_rc": rc, "pid": os.getpid()}), flush=True)
    time.sleep(float(os.environ.get('HOLD_S', '8')))
else:
    for _ in range(200):
        if os.path.exists(hfile): break
        time.sleep(0.05)
    raw = H.from_buffer_copy(open(hfile, "rb").read())
    ptr = ctypes.c_uint64()
    fn = lib.cuIpcOpenMemHandle_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), H, ctypes.c_uint]
    rc = fn(ctypes.byref(ptr), raw, 1)
    val = None
    if rc == 0:
        buf = (ctypes.c_uint8 * 1)()
        lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ptr.value), ctypes.c_size_t(1)); val = buf[0]
    print(json.dumps({"role": role, "open_rc": rc, "value": val, "pid": os.getpid()}), flush=True)
EOF
chmod 0644 "$ROOT/ipc.py"
CTL=$(command -v nvidia-cuda-mps-control || echo /usr/bin/nvidia-cuda-mps-control)
as_uid() { setpriv --reuid="$U" --regid="$U" --clear-groups env HOME="$ROOT" "$@"; }
case_run() {  # NAME PIDNS(0/1/shm/tmp)
  local name=$1 ns=$2 hf=$ROOT/$1.handle
  echo "== $name"
  if [ "$ns" = shm ] || [ "$ns" = tmp ]; then  # as the sandbox: own PID namespace, a private /dev/shm or /var/tmp
    local tgt=/dev/shm; [ "$ns" = tmp ] && tgt=/var/tmp
    local wrap="mount --make-rprivate / && mount -t tmpfs -o mode=1777 tmpfs $tgt && exec unshare --pid --fork --kill-child --mount-proc setpriv --reuid=$U --regid=$U --clear-groups env HOME=$ROOT"
    unshare --mount sh -c "$wrap $PY $ROOT/ipc.py holder $hf" & H=$!
    sleep 0.5
    unshare --mount sh -c "$wrap timeout 40 $PY $ROOT/ipc.py mapper $hf"
  elif [ "$ns" = samepid ] || [ "$ns" = ranges ]; then
    # As the process backend's MPS clients: the runtime is PID 1 and the process that exports or maps is its
    # child, in a namespace each. samepid: both children are PID 2; ranges: the sandbox's ns_last_pid slots.
    local a=0 b=0; [ "$ns" = ranges ] && a=1000 b=2000
    local pre='{ [ "$0" != 0 ] && echo "$0" > /proc/sys/kernel/ns_last_pid; } 2>/dev/null; exec "$@"'
    unshare --pid --fork --kill-child --mount-proc sh -c "$pre" $a setpriv --reuid="$U" --regid="$U" --clear-groups env HOME="$ROOT" timeout 40 $PY "$ROOT/ipc.py" holder "$hf" & H=$!
    sleep 0.5
    unshare --pid --fork --kill-child --mount-proc sh -c "$pre" $b setpriv --reuid="$U" --regid="$U" --clear-groups env HOME="$ROOT" timeout 40 $PY "$ROOT/ipc.py" mapper "$hf"
  elif [ "$ns" = 1 ]; then
    unshare --pid --fork --kill-child --mount-proc setpriv --reuid="$U" --regid="$U" --clear-groups env HOME="$ROOT" $PY "$ROOT/ipc.py" holder "$hf" & H=$!
    sleep 0.5
    unshare --pid --fork --kill-child --mount-proc setpriv --reuid="$U" --regid="$U" --clear-groups env HOME="$ROOT" timeout 40 $PY "$ROOT/ipc.py" mapper "$hf"
  else
    as_uid $PY "$ROOT/ipc.py" holder "$hf" & H=$!
    sleep 0.5
    as_uid timeout 40 $PY "$ROOT/ipc.py" mapper "$hf"
  fi
  wait $H
}
if [ -n "${ONLY_PIDS:-}" ]; then  # same PID in both namespaces vs. the sandbox's PID ranges, without and with MPS
  export HOLD_S=4
  case_run nomps_samepid samepid
  case_run nomps_ranges ranges
  export CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD
  "$CTL" -d && sleep 1
  case_run mps_samepid samepid
  case_run mps_ranges ranges
  echo quit | "$CTL"; sleep 1; rm -rf "$ROOT"; echo "== done"; exit 0
fi
if [ -n "${ONLY_PRIVATE:-}" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD HOLD_S=4
  "$CTL" -d && sleep 1
  case_run mps_pidns_private_shm shm
  case_run mps_pidns_private_vartmp tmp
  case_run mps_pidns 1
  echo quit | "$CTL"; sleep 1; rm -rf "$ROOT"; echo "== done"; exit 0
fi
case_run nomps_samens 0
case_run nomps_pidns 1
export CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD
"$CTL" -d && sleep 1
case_run mps_samens 0
case_run mps_pidns 1
echo quit | "$CTL"; sleep 1
rm -rf "$ROOT"
echo "== done"
