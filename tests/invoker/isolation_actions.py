"""Actions that try to escape their container, each answering ``{"escaped": bool, ...}`` (stdlib only).

Shared by the isolation matrix (``test_isolation.py``): every backend that runs here must deny or clean
up every attempt.
"""

from __future__ import annotations

SHADOW = """
def main(a):
    try:
        return {"escaped": True, "detail": open("/etc/shadow").read()[:40]}
    except OSError as exc:
        return {"escaped": False, "detail": repr(exc)}
"""

#: walks a directory of the host (the data dir: redis.conf, the invoker's credentials; the work dir of
#: other containers) and reads whatever it can
READ_TREE = """
import os
def main(a):
    read, denied = [], []
    for top in a["paths"]:
        if os.path.isfile(top):
            candidates = [top]
        else:
            candidates = []
            for root, dirs, files in os.walk(top, onerror=lambda e: denied.append(repr(e))):
                candidates += [os.path.join(root, f) for f in files]
            if not os.path.exists(top):
                denied.append("absent: " + top)
        for path in candidates:
            try:
                with open(path, "rb") as f:
                    f.read(16)
                read.append(path)
            except OSError as exc:
                denied.append(repr(exc))
    return {"escaped": bool(read), "read": read[:20], "denied": denied[:20]}
"""

#: finds every listening TCP port it can see and tries the runtime's /run, the invoker's control
#: endpoint and Redis without credentials; also any runtime URL it is told about
NETWORK = """
import json, socket, urllib.request, urllib.error
def listening():
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A":
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return sorted(ports)
def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status, r.read(200).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except Exception as exc:
        return None, repr(exc)
def redis_keys(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"KEYS *\\r\\n")
            return s.recv(64)
    except Exception:
        return b""
def main(a):
    hits, tried = [], []
    urls = list(a.get("urls", []))
    ports = listening()
    urls += ["http://127.0.0.1:%d" % p for p in ports]
    for base in urls:
        for path, body in (("/run", {"value": {}}), ("/invoker/disable", {})):
            status, text = post(base + path, body)
            tried.append([base + path, status])
            if status == 200:
                hits.append([base + path, text])
    for port in ports:
        reply = redis_keys(port)
        if reply.startswith(b"*"):
            hits.append(["redis:%d" % port, reply.decode(errors="replace")])
    return {"escaped": bool(hits), "hits": hits, "tried": tried[:40]}
"""

VICTIM = """
import os
def main(a):
    paths = []
    for d in (os.environ.get("HOME", "/tmp"), "/tmp"):
        p = os.path.join(d, "victim-secret.txt")
        try:
            with open(p, "w") as f:
                f.write("victim's data")
        except OSError:
            continue
        paths.append(p)
    return {"paths": paths}
"""

#: writes to its own GPU control block (the share the manager gives it)
CONTROL_BLOCK = """
import os
def main(a):
    path = os.environ.get("DILU_SHIM_CONTROL") or os.environ.get(a.get("env", ""), "")
    if not path:
        return {"escaped": False, "detail": "no control block", "missing": True}
    try:
        with open(path, "r+b") as f:
            f.write(b"\\xff")
        return {"escaped": True, "detail": path}
    except OSError as exc:
        readable = True
        try:
            open(path, "rb").read(8)
        except OSError:
            readable = False
        return {"escaped": False, "detail": repr(exc), "readable": readable}
"""

MEMORY = """
def main(a):
    blocks = []
    for _ in range(a["mb"] // 32):
        blocks.append(b"x" * (32 << 20))
    return {"escaped": True, "allocated_mb": 32 * len(blocks)}
"""

#: over its memory limit at import, as `import torch` is under the default 256 MB
MEMORY_AT_INIT = """
blocks = [b"x" * (32 << 20) for _ in range(20)]
def main(a):
    return {"escaped": True, "allocated_mb": 32 * len(blocks)}
"""

#: a double-forked daemon in its own session plus a start_new_session child
DAEMON = """
import os, subprocess, time
def main(a):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            time.sleep(600)
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    daemon = int(os.read(r, 32))
    child = subprocess.Popen(["sleep", "600"], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {"pids": [daemon, child.pid]}
"""

LEAVE_FILES = """
import os
def main(a):
    left = []
    for d in ("/tmp", "/var/tmp", "/dev/shm", os.environ.get("HOME", "/tmp")):
        p = os.path.join(d, "dilu-left-" + a["token"])
        try:
            with open(p, "w") as f:
                f.write("left behind")
            left.append(p)
        except OSError:
            pass
    return {"left": left}
"""

#: a GPU action that, as an MPS client, shares its uid with the other clients of its GPU: it leaves files
#: in its home, /tmp and /dev/shm (``token``), reads what it is told to (``steal``), signals the pids it
#: is told to (``signal``) and tries to plant a file among the MPS daemon's pipes
MPS_MEMBER = """
import os
def main(a):
    out = {"uid": os.getuid(), "pid": os.getpid(), "home": os.environ.get("HOME"),
           "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
    if a.get("token"):
        out["left"] = []
        for d in (os.environ["HOME"], "/tmp", "/dev/shm"):
            path = os.path.join(d, "secret-" + a["token"])
            with open(path, "w") as f:
                f.write("secret")
            out["left"].append(path)
    out["read"] = []
    for path in a.get("steal", []):
        try:
            with open(path) as f:
                f.read()
            out["read"].append(path)
        except OSError:
            pass
    out["signalled"] = []
    for pid in a.get("signal", []):
        try:
            os.kill(pid, 0)
            out["signalled"].append(pid)
        except OSError:
            pass
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or ""
    out["pipe"] = pipe
    out["pipe_listing"] = sorted(os.listdir(pipe)) if os.path.isdir(pipe) else None
    try:
        with open(os.path.join(pipe, "control.planted"), "w"):
            pass
        out["pipe_writable"] = True
    except OSError as exc:
        out["pipe_writable"] = False
        out["pipe_error"] = repr(exc)
    return out
"""
