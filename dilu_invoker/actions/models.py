"""Models for GPU functions: named loaders, fast weight loading, and read-only weights shared between
instances of one function on one GPU (docs/runtime.md, "models").

    from dilu_invoker.actions import models

    def build():                        # builds the module on the CPU; random or real weights
        import torchvision
        return torchvision.models.resnet50(weights=None).half().eval()

    net = models.load("resnet50", build)              # an nn.Module whose weights are on the GPU
    w = models.load("llm", "/data/llm.safetensors")   # a dict name -> tensor, read with the fast loader

``load`` is idempotent within a process (the second call returns the same object). Under the invoker, the
first instance of a function on a GPU becomes the *holder* of the weights: it copies them into one device
allocation and serves its CUDA IPC handle on a per-function endpoint; the next instance of the same function
(same namespace, action and revision) on the same GPU *maps* that allocation instead of copying: it builds the
module's structure on the ``meta`` device and points its parameters at the holder's memory. Only processes
that know the function's key (``DILU_MODELS_KEY``, an HMAC the invoker derives per function and hands to the
instance at /init) can obtain the handle: both sides prove knowledge of the key (HMAC challenges), so another
function can neither fetch the handle nor pose as a holder. When the holder dies, a mapping instance loads the
weights itself and becomes the holder; a new instance that finds no holder loads itself.

Without CUDA (or without torch) the same API works on the CPU: weights are numpy arrays (or memoryviews
without numpy) and a holder shares them through a memfd passed over the Unix socket (``SCM_RIGHTS``), mapped
read-only by the other instance.

Weight files use the safetensors layout (8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes); ``save_file`` writes one. ``read_weights`` reads
a file with several threads into pinned host buffers and copies them to the GPU asynchronously (one CUDA
stream per thread, two buffers each); with ``host_cache=True`` the file's bytes stay in pinned host memory
so that a later load of the same file (a new instance after a scale-in) copies at PCIe speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import json
import mmap
import os
import secrets
import socket
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ENV_KEY = "DILU_MODELS_KEY"
#: safetensors dtype names -> (numpy name or None, item size)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("uint16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
ALIGN = 256  # every tensor's slot in a shared allocation starts at a multiple of this
_HELLO = b"dilu-models/1"


class ModelsError(RuntimeError):
    """A weights file or a sharing peer that cannot be used."""


# -- the weights file format (safetensors layout) --------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "F16"
    shape: tuple[int, ...]
    start: int  # byte offset from the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str) -> tuple[list[TensorInfo], int]:
    """The tensors of a safetensors file and the file offset where their data starts."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ModelsError(f"{path}: not a weights file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > 100 * 1024 * 1024:
            raise ModelsError(f"{path}: header of {length} bytes is not plausible")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise ModelsError(f"{path}: header is not JSON ({exc})") from None
    size = os.path.getsize(path)
    infos: list[TensorInfo] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta.get("dtype")
        if dtype not in DTYPES:
            raise ModelsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        start, end = (int(x) for x in meta["data_offsets"])
        shape = tuple(int(x) for x in meta["shape"])
        count = 1
        for dim in shape:
            count *= dim
        if end - start != count * DTYPES[dtype][1] or start < 0 or 8 + length + end > size:
            raise ModelsError(f"{path}: tensor {name!r} has an inconsistent byte range")
        infos.append(TensorInfo(name, dtype, shape, start, end))
    infos.sort(key=lambda t: t.start)
    return infos, 8 + length


def save_file(path: str, tensors: dict[str, Any], *, chunk_bytes: int = 256 << 20) -> int:
    """Write ``tensors`` (numpy arrays or torch tensors) as a safetensors file (mode 0600); returns its size."""
    import numpy as np

    entries: dict[str, Any] = {}
    arrays: list[tuple[str, Any]] = []
    offset = 0
    for name, value in tensors.items():
        dtype, arr = _as_numpy(value)
        entries[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append((name, arr))
        offset += arr.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header)
        for _, arr in arrays:
            flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            for i in range(0, flat.size, chunk_bytes):
                out.write(flat[i:i + chunk_bytes].data)
    return 8 + len(header) + offset


def _as_numpy(value: Any) -> tuple[str, Any]:
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor
        tname = str(value.dtype).replace("torch.", "")
        rev = {v: k for k, v in _TORCH_DTYPES.items()}
        if tname not in rev:
            raise ModelsError(f"unsupported torch dtype {tname}")
        t = value.detach().contiguous().cpu()
        if tname == "bfloat16":
            import torch

            t = t.view(torch.int16)
        return rev[tname], t.numpy()
    arr = np.asarray(value)
    for key, (npname, _) in DTYPES.items():
        if key != "BF16" and arr.dtype == np.dtype(npname):
            return key, arr
    raise ModelsError(f"unsupported numpy dtype {arr.dtype}")


# -- optional libraries -----------------------------------------------------------------------------------


def _torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cuda_available() -> bool:
    torch = _torch()
    return bool(torch is not None and torch.cuda.is_available())


def _resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if _cuda_available() else "cpu"
    if device.startswith("cuda") and not _cuda_available():
        raise ModelsError(f"device {device!r} asked for, but CUDA is not available")
    return device


# -- fast loading --------------------------------------------------------------------------------------------


@dataclass
class Weights:
    """What ``read_weights`` returns: the tensors (views of one flat buffer) and how they were read."""

    tensors: dict[str, Any]
    flat: Any  # uint8 tensor / numpy array / bytearray holding every tensor
    nbytes: int
    seconds: float
    device: str
    source: str  # "file" or "host-cache"
    threads: int


_host_cache: dict[tuple[str, int, int], Any] = {}  # (path, size, mtime_ns) -> pinned uint8 tensor
_host_cache_lock = threading.Lock()


def _chunks(total: int, chunk: int, threads: int) -> list[list[tuple[int, int]]]:
    """Split [0, total) into chunk-sized pieces dealt round-robin to ``threads`` workers."""
    pieces = [(off, min(chunk, total - off)) for off in range(0, total, chunk)]
    return [pieces[i::threads] for i in range(threads)]


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise ModelsError(f"short read at offset {offset + got}")
        got += n


def default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


def read_weights(path: str, *, device: str | None = None, threads: int | None = None,
                 chunk_bytes: int = 32 << 20, host_cache: bool = False, out: Any = None) -> Weights:
    """Read a safetensors file with parallel reads; on CUDA through pinned buffers and async copies.

    ``out``: an existing flat uint8 buffer (device or host) of at least the data size to fill (the shared
    allocation of ``load``); otherwise one is allocated on ``device``.
    """
    infos, data_start = read_header(path)
    total = infos[-1].end if infos else 0
    device = _resolve_device(device)
    threads = threads or default_threads()
    t0 = time.perf_counter()
    stat = os.stat(path)
    cache_key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    source = "file"
    if device.startswith("cuda"):
        torch = _torch()
        assert torch is not None
        flat = out if out is not None else torch.empty(total, dtype=torch.uint8, device=device)
        with _host_cache_lock:
            cached = _host_cache.get(cache_key)
        if cached is not None:
            flat[:total].copy_(cached[:total], non_blocking=True)
            torch.cuda.synchronize(flat.device)
            source = "host-cache"
        elif host_cache:
            pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            _parallel_read_host(path, data_start, memoryview(pinned.numpy()), total, threads, chunk_bytes)
            flat[:total].copy_(pinned, non_blocking=True)
            torch.cuda.synchronize(flat.device)
            with _host_cache_lock:
                _host_cache[cache_key] = pinned
        else:
            _parallel_read_cuda(torch, path, data_start, flat, total, threads, chunk_bytes)
        tensors = {i.name: flat[i.start:i.end].view(getattr(torch, _TORCH_DTYPES[i.dtype])).view(i.shape)
                   for i in infos}
    else:
        flat = out if out is not None else _host_buffer(total)
        view = memoryview(flat).cast("B") if not isinstance(flat, memoryview) else flat
        _parallel_read_host(path, data_start, view, total, threads, chunk_bytes)
        tensors = _host_views(flat, infos)
    return Weights(tensors, flat, total, time.perf_counter() - t0, device, source, threads)


def drop_host_cache() -> None:
    with _host_cache_lock:
        _host_cache.clear()


def _host_buffer(total: int) -> Any:
    try:
        import numpy as np
    except ImportError:
        return bytearray(total)
    return np.empty(total, dtype=np.uint8)


def _host_views(flat: Any, infos: list[TensorInfo]) -> dict[str, Any]:
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    out: dict[str, Any] = {}
    for i in infos:
        if np is not None:
            arr = np.frombuffer(flat, dtype=np.uint8, count=i.nbytes, offset=i.start)
            out[i.name] = arr.view(DTYPES[i.dtype][0]).reshape(i.shape)
        else:
            fmt = {"F64": "d", "F32": "f", "F16": "e", "BF16": "H", "I64": "q", "I32": "i", "I16": "h",
                   "I8": "b", "U8": "B", "BOOL": "?"}[i.dtype]
            out[i.name] = memoryview(flat)[i.start:i.end].cast(fmt)
    return out


def _parallel_read_host(path: str, data_start: int, view: memoryview, total: int, threads: int,
                        chunk_bytes: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fd, data_start, total, os.POSIX_FADV_SEQUENTIAL)
        errors: list[BaseException] = []

        def work(pieces: list[tuple[int, int]]) -> None:
            try:
                for off, n in pieces:
                    _pread_into(fd, view[off:off + n], data_start + off)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        _run_threads(work, _chunks(total, chunk_bytes, threads))
        if errors:
            raise errors[0]
    finally:
        os.close(fd)


def _parallel_read_cuda(torch: Any, path: str, data_start: int, flat: Any, total: int, threads: int,
                        chunk_bytes: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    errors: list[BaseException] = []
    device = flat.device

    def work(pieces: list[tuple[int, int]]) -> None:
        try:
            if not pieces:
                return
            stream = torch.cuda.Stream(device=device)
            bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            views = [memoryview(b.numpy()) for b in bufs]
            events: list[Any] = [None, None]
            for k, (off, n) in enumerate(pieces):
                slot = k % 2
                if events[slot] is not None:
                    events[slot].synchronize()  # the copy out of this buffer is done: reuse it
                _pread_into(fd, views[slot][:n], data_start + off)
                with torch.cuda.stream(stream):
                    flat[off:off + n].copy_(bufs[slot][:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                events[slot] = ev
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    try:
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fd, data_start, total, os.POSIX_FADV_SEQUENTIAL)
        _run_threads(work, _chunks(total, chunk_bytes, threads))
    finally:
        os.close(fd)
    if errors:
        raise errors[0]


def _run_threads(work: Callable[[list[tuple[int, int]]], None], parts: list[list[tuple[int, int]]]) -> None:
    pool = [threading.Thread(target=work, args=(p,), daemon=True) for p in parts if p]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def plain_read(path: str, device: str | None = None) -> Weights:
    """The plain path, for comparison: one read of the whole file, then one copy to the device."""
    infos, data_start = read_header(path)
    device = _resolve_device(device)
    t0 = time.perf_counter()
    data = bytearray(os.path.getsize(path) - data_start)
    with open(path, "rb", buffering=0) as handle:
        handle.seek(data_start)
        got = 0
        view = memoryview(data)
        while got < len(data):
            n = handle.readinto(view[got:])
            if not n:
                raise ModelsError(f"{path}: short read")
            got += n
    torch = _torch()
    if device.startswith("cuda") and torch is not None:
        flat = torch.frombuffer(data, dtype=torch.uint8).to(device)
        torch.cuda.synchronize(flat.device)
        tensors = {i.name: flat[i.start:i.end].view(getattr(torch, _TORCH_DTYPES[i.dtype])).view(i.shape)
                   for i in infos}
    else:
        flat = data
        tensors = _host_views(flat, infos)
    return Weights(tensors, flat, len(data), time.perf_counter() - t0, device, "file", 1)


# -- shared allocations -------------------------------------------------------------------------------------


class _CudaDriver:
    """The few driver entry points sharing needs, through ctypes on libcuda (the shim sees them too)."""

    def __init__(self, lib: str | None = None) -> None:
        self.lib = ctypes.CDLL(lib or os.environ.get("DILU_LIBCUDA", "libcuda.so.1"))
        self._check(self.lib.cuInit(0), "cuInit")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise ModelsError(f"{what} failed with CUDA error {rc}")

    def ensure_context(self, ordinal: int = 0) -> None:
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(max(1, nbytes))), "cuMemAlloc")
        return int(ptr.value)

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
                    "cuMemGetAddressRange")
        return int(base.value), int(size.value)

    def export(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), 64)  # all 64 bytes (.reserved stops at a NUL)

    def open(self, handle: bytes) -> int:
        if len(handle) != 64:
            raise ModelsError("a CUDA IPC handle has 64 bytes")
        ptr = ctypes.c_uint64()
        fn = self.lib.cuIpcOpenMemHandle_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]  # the handle by value
        raw = _IpcHandle.from_buffer_copy(handle)
        self._check(fn(ctypes.byref(ptr), raw, 1), "cuIpcOpenMemHandle")  # 1: lazy peer access
        return int(ptr.value)

    def close(self, ptr: int) -> None:
        self._check(self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _DeviceBuffer:
    """A raw device allocation as a CUDA array (``torch.as_tensor`` wraps it without copying)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        # torch refuses the read-only flag; a mapper's tensors are read-only by contract, not by the flag
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


@dataclass
class _Shared:
    """One process's side of a shared allocation."""

    kind: str  # "cuda-ipc" or "memfd"
    nbytes: int
    flat: Any  # uint8 tensor (cuda) or memoryview/numpy (memfd)
    handle: bytes = b""  # cuda-ipc: the 64-byte handle
    fd: int = -1  # memfd: the file descriptor (holder and mapper)
    offset: int = 0  # cuda-ipc: where the buffer starts in the exported segment
    keep: list[Any] = field(default_factory=list)  # objects that must outlive the mapping


def _alloc_shared(nbytes: int, device: str) -> _Shared:
    if device.startswith("cuda"):
        torch = _torch()
        assert torch is not None
        # Through torch's allocator (and so through the shim, which counts it against this instance's
        # memory cap); the handle covers the allocation's whole segment, the offset finds the buffer in it.
        flat = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)[:nbytes]
        driver = _driver()
        torch.cuda.synchronize()  # makes torch's context current in this thread
        driver.ensure_context(torch.cuda.current_device())
        base, _size = driver.address_range(flat.data_ptr())
        handle = driver.export(base)
        return _Shared("cuda-ipc", nbytes, flat, handle=handle, offset=flat.data_ptr() - base)
    fd = os.memfd_create("dilu-model", os.MFD_CLOEXEC)
    os.ftruncate(fd, max(1, nbytes))
    mem = mmap.mmap(fd, max(1, nbytes), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return _Shared("memfd", nbytes, memoryview(mem)[:nbytes], fd=fd, keep=[mem])


def _map_shared(kind: str, nbytes: int, handle: bytes, fd: int, device: str, offset: int = 0) -> _Shared:
    if kind == "cuda-ipc":
        torch = _torch()
        if torch is None or not device.startswith("cuda"):
            raise ModelsError("the holder shares CUDA memory but this instance has no CUDA")
        driver = _driver()
        torch.cuda.synchronize()
        driver.ensure_context(torch.cuda.current_device())
        ptr = driver.open(handle) + offset
        buf = _DeviceBuffer(ptr, nbytes)
        return _Shared(kind, nbytes, torch.as_tensor(buf, device=device), handle=handle, keep=[buf],
                       offset=offset)
    if kind == "memfd":
        if os.fstat(fd).st_size < nbytes:
            raise ModelsError("the shared memory is smaller than its layout says")
        mem = mmap.mmap(fd, max(1, nbytes), mmap.MAP_SHARED, mmap.PROT_READ)
        return _Shared(kind, nbytes, memoryview(mem)[:nbytes], fd=fd, keep=[mem])
    raise ModelsError(f"unknown sharing kind {kind!r}")


_driver_obj: _CudaDriver | None = None


def _driver() -> _CudaDriver:
    global _driver_obj
    if _driver_obj is None:
        _driver_obj = _CudaDriver()
    return _driver_obj


# -- the handle exchange -------------------------------------------------------------------------------------


def endpoint(key: bytes, name: str, device_id: str) -> bytes:
    """The abstract Unix socket address of one model of one function on one GPU (derived from the key)."""
    digest = hashlib.sha256(b"dilu-models-endpoint\0" + key + b"\0" + name.encode() + b"\0" +
                            device_id.encode()).hexdigest()[:40]
    return b"\0dilu-models-" + digest.encode()


def _proof(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + b"\0" + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("peer closed the connection")
        data += part
    return data


class Holder:
    """Serves a shared allocation's handle and layout to instances that prove they know the key."""

    def __init__(self, key: bytes, address: bytes, shared: _Shared, layout: dict[str, Any]) -> None:
        self.key, self.address, self.shared, self.layout = key, address, shared, layout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address)  # EADDRINUSE: another instance holds it already
        self.sock.listen(16)
        self.served = 0
        self.refused = 0
        self._peers: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="dilu-models-holder", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            nonce = secrets.token_bytes(32)
            conn.sendall(_HELLO + nonce)
            answer = _recv_exact(conn, 64)
            their_nonce, proof = answer[:32], answer[32:]
            if not hmac.compare_digest(proof, _proof(self.key, b"client", nonce)):
                self.refused += 1
                conn.close()
                return
            body = json.dumps({"kind": self.shared.kind, "nbytes": self.shared.nbytes, "offset": self.shared.offset,
                               "handle": self.shared.handle.hex(), "layout": self.layout}).encode()
            msg = _proof(self.key, b"server", their_nonce) + struct.pack(">I", len(body)) + body
            if self.shared.kind == "memfd":
                socket.send_fds(conn, [msg], [self.shared.fd])
            else:
                conn.sendall(msg)
            self.served += 1
            conn.settimeout(None)
            self._peers.append(conn)  # kept open: its closing tells the mapper that the holder died
        except (OSError, ConnectionError):
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        for peer in self._peers:
            with contextlib.suppress(OSError):
                peer.close()


def fetch(key: bytes, address: bytes, timeout: float = 5.0) -> tuple[dict[str, Any], int, socket.socket]:
    """Obtain a holder's layout (and, for memfd, its fd); raises PermissionError when proofs do not match,
    ConnectionError when there is no holder. The returned socket stays open while the mapping is used."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except OSError as exc:
        sock.close()
        raise ConnectionError(f"no holder ({exc.strerror})") from None
    try:
        hello = _recv_exact(sock, len(_HELLO) + 32)
        if not hello.startswith(_HELLO):
            raise PermissionError("the peer does not speak the models protocol")
        mine = secrets.token_bytes(32)
        sock.sendall(mine + _proof(key, b"client", hello[len(_HELLO):]))
        msg, fds, _, _ = socket.recv_fds(sock, 65536, 1)
        if not msg:
            raise PermissionError("the holder refused this instance's key")
        while len(msg) < 36:
            more = sock.recv(65536)
            if not more:
                raise ConnectionError("holder closed early")
            msg += more
        if not hmac.compare_digest(msg[:32], _proof(key, b"server", mine)):
            for fd in fds:
                os.close(fd)
            raise PermissionError("the peer could not prove it holds this function's key")
        (length,) = struct.unpack(">I", msg[32:36])
        body = msg[36:]
        while len(body) < length:
            more = sock.recv(length - len(body))
            if not more:
                raise ConnectionError("holder closed early")
            body += more
        info = json.loads(body)
        sock.settimeout(None)
        return info, (fds[0] if fds else -1), sock
    except BaseException:
        sock.close()
        raise


# -- named models -------------------------------------------------------------------------------------------


@dataclass
class Model:
    """The state of one named model in this process (``models.info(name)``)."""

    name: str
    role: str  # "holder", "mapped" or "local" (no sharing: no key, or sharing failed)
    device: str
    nbytes: int
    seconds: float
    value: Any  # what load returned
    shared: _Shared | None = None
    holder: Holder | None = None
    link: socket.socket | None = None
    reason: str = ""
    reloads: int = 0
    watcher: threading.Thread | None = None


_models: dict[str, Model] = {}
_lock = threading.RLock()


def info(name: str) -> Model | None:
    return _models.get(name)


def function_key() -> bytes | None:
    raw = os.environ.get(ENV_KEY)
    return raw.encode() if raw else None


def derive_key(secret: bytes, namespace: str, action: str, revision: str) -> str:
    """The key the invoker hands to every instance of one function (namespace/action@revision)."""
    return hmac.new(secret, f"{namespace}\0{action}\0{revision}".encode(), hashlib.sha256).hexdigest()


def _device_id(device: str) -> str:
    if device.startswith("cuda"):
        torch = _torch()
        assert torch is not None
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        return str(getattr(props, "uuid", "")) or f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}:{index}"
    return "cpu"


def load(name: str, loader: Callable[[], Any] | str, *, device: str | None = None, share: bool = True,
         threads: int | None = None) -> Any:
    """Load (or map) the model ``name``; ``loader`` builds it on the CPU (an nn.Module or a dict of tensors /
    arrays) or is the path of a safetensors file. Returns the module, or a dict name -> tensor."""
    with _lock:
        model = _models.get(name)
        if model is not None:
            return model.value
        device = _resolve_device(device)
        key = function_key() if share else None
        model = _load_new(name, loader, device, key, threads)
        _models[name] = model
        return model.value


def _load_new(name: str, loader: Callable[[], Any] | str, device: str, key: bytes | None,
              threads: int | None, reloads: int = 0) -> Model:
    t0 = time.perf_counter()
    if key is None:
        value, nbytes = _load_local(loader, device, threads)
        return Model(name, "local", device, nbytes, time.perf_counter() - t0, value,
                     reason=f"no {ENV_KEY}: not shared", reloads=reloads)
    address = endpoint(key, name, _device_id(device))
    reason = ""
    try:
        layout_info, fd, link = fetch(key, address)
    except ConnectionError as exc:
        reason = str(exc)
    except PermissionError as exc:
        reason = f"refused: {exc}"
    else:
        try:
            shared = _map_shared(layout_info["kind"], int(layout_info["nbytes"]), bytes.fromhex(
                layout_info["handle"]), fd, device, int(layout_info.get("offset", 0)))
            value = _materialize(loader, layout_info["layout"], shared.flat, device)
        except (ModelsError, OSError) as exc:
            link.close()
            reason = f"could not map: {exc}"
        else:
            model = Model(name, "mapped", device, shared.nbytes, time.perf_counter() - t0, value, shared=shared,
                          link=link, reloads=reloads)
            _watch(model, loader, key, threads)
            return model
    # Become the holder: one allocation, every tensor in it, its handle served.
    value, shared, layout = _load_into_shared(loader, device, threads)
    try:
        holder: Holder | None = Holder(key, address, shared, layout)
    except OSError as exc:  # another instance won the race: keep this copy, unshared
        holder = None
        reason = f"{reason}; endpoint taken ({exc.strerror})"
    role = "holder" if holder is not None else "local"
    return Model(name, role, device, shared.nbytes, time.perf_counter() - t0, value, shared=shared,
                 holder=holder, reason=reason, reloads=reloads)


def _watch(model: Model, loader: Callable[[], Any] | str, key: bytes, threads: int | None) -> None:
    """When the holder dies, load the weights into this process and take over as the holder."""

    def run() -> None:
        assert model.link is not None
        with contextlib.suppress(OSError):
            while model.link.recv(4096):
                pass
        with _lock:
            if _models.get(model.name) is not model:
                return
            fresh = _load_new(model.name, loader, model.device, key, threads, reloads=model.reloads + 1)
            _swap_in(model.value, fresh.value)
            fresh.value = model.value
            _models[model.name] = fresh

    model.watcher = threading.Thread(target=run, name=f"dilu-models-watch-{model.name}", daemon=True)
    model.watcher.start()


def _swap_in(target: Any, fresh: Any) -> None:
    """Point the object the user holds at the fresh copy's tensors."""
    if isinstance(target, dict):
        target.clear()
        target.update(fresh)
        return
    for dotted, tensor in _named_tensors(fresh):
        _set_tensor(target, dotted, tensor)


# -- what a loader gives ---------------------------------------------------------------------------------------


def _is_module(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.nn.Module)


def _named_tensors(module: Any) -> Iterator[tuple[str, Any]]:
    for dotted, t in list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False)):
        if t is not None:
            yield dotted, t


def _set_tensor(module: Any, dotted: str, tensor: Any) -> None:
    torch = _torch()
    assert torch is not None
    owner_path, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor


def _layout_of(items: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[dict[str, Any], int]:
    """items: (name, dtype, shape, nbytes) -> {name: [dtype, shape, offset]}, total bytes (aligned slots)."""
    layout: dict[str, Any] = {}
    off = 0
    for name, dtype, shape, nbytes in items:
        off += -off % ALIGN
        layout[name] = [dtype, list(shape), off, nbytes]
        off += nbytes
    return layout, off


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _load_local(loader: Callable[[], Any] | str, device: str, threads: int | None) -> tuple[Any, int]:
    if isinstance(loader, str):
        w = read_weights(loader, device=device, threads=threads)
        return w.tensors, w.nbytes
    value = loader()
    if _is_module(value):
        value = value.to(device).eval()
        return value, sum(t.numel() * t.element_size() for _, t in _named_tensors(value))
    if isinstance(value, dict):
        torch = _torch()
        if torch is not None and device.startswith("cuda"):
            value = {k: torch.as_tensor(v).to(device) for k, v in value.items()}
        return value, sum(int(getattr(v, "nbytes", 0)) for v in value.values())
    raise ModelsError("a loader returns an nn.Module, a dict of tensors or arrays, or is a file path")


def _load_into_shared(loader: Callable[[], Any] | str, device: str,
                      threads: int | None) -> tuple[Any, _Shared, dict[str, Any]]:
    if isinstance(loader, str):
        infos, _ = read_header(loader)
        items = [(i.name, i.dtype, i.shape, i.nbytes) for i in infos]
        # The file's own offsets are kept (no realignment): one parallel read fills the allocation.
        total = infos[-1].end if infos else 0
        shared = _alloc_shared(total, device)
        w = read_weights(loader, device=device, threads=threads, out=shared.flat)
        layout = {name: [dtype, list(shape), i.start, nbytes] for (name, dtype, shape, nbytes), i
                  in zip(items, infos, strict=True)}
        return w.tensors, shared, {"format": "file", "tensors": layout}
    value = loader()
    if _is_module(value):
        named = list(_named_tensors(value))
        items = [(d, _torch_dtype_name(t), tuple(t.shape), t.numel() * t.element_size()) for d, t in named]
        layout, total = _layout_of(items)
        shared = _alloc_shared(total, device)
        value = value.eval()
        for dotted, t in named:
            view = _torch_view(shared.flat, layout[dotted])
            view.copy_(t.detach())
            _set_tensor(value, dotted, view)
        value.to(device)  # anything not a parameter or buffer
        return value, shared, {"format": "module", "tensors": layout}
    if isinstance(value, dict):
        arrays = {k: _as_numpy(v) for k, v in value.items()}
        items = [(k, dt, tuple(a.shape), int(a.nbytes)) for k, (dt, a) in arrays.items()]
        layout, total = _layout_of(items)
        shared = _alloc_shared(total, device)
        out = _views_of(shared.flat, layout, device)
        for k, (_, a) in arrays.items():
            _copy_into(out[k], a, device)
        return out, shared, {"format": "dict", "tensors": layout}
    raise ModelsError("a loader returns an nn.Module, a dict of tensors or arrays, or is a file path")


def _torch_view(flat: Any, slot: list[Any]) -> Any:
    torch = _torch()
    assert torch is not None
    dtype, shape, off, nbytes = slot
    if not isinstance(flat, torch.Tensor):  # a memfd mapping (CPU sharing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a mapper's mapping is read-only
            flat = torch.frombuffer(flat, dtype=torch.uint8) if len(flat) else torch.empty(0, dtype=torch.uint8)
    tdt = getattr(torch, dtype if dtype in _TORCH_DTYPES.values() else _TORCH_DTYPES[dtype])
    return flat[off:off + nbytes].view(tdt).view(tuple(shape))


def _views_of(flat: Any, layout: dict[str, Any], device: str) -> dict[str, Any]:
    if device.startswith("cuda"):
        return {k: _torch_view(flat, slot) for k, slot in layout.items()}
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    out: dict[str, Any] = {}
    for k, (dtype, shape, off, nbytes) in layout.items():
        if np is None:
            out[k] = flat[off:off + nbytes]
            continue
        npname = DTYPES[dtype][0] if dtype in DTYPES else dtype
        out[k] = np.frombuffer(flat, dtype=np.uint8, count=nbytes, offset=off).view(npname).reshape(shape)
    return out


def _copy_into(dst: Any, src: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch = _torch()
        assert torch is not None
        dst.copy_(torch.from_numpy(src).view(dst.dtype).view(dst.shape))
    elif hasattr(dst, "shape"):
        dst[...] = src
    else:
        dst[:] = memoryview(src.reshape(-1).view("uint8"))


def _materialize(loader: Callable[[], Any] | str, layout: dict[str, Any], flat: Any, device: str) -> Any:
    """The mapper's side: tensors are views of the mapped allocation; a module is built on ``meta``."""
    fmt, slots = layout["format"], layout["tensors"]
    if fmt in ("file", "dict"):
        return _views_of(flat, slots, device)
    torch = _torch()
    if torch is None or isinstance(loader, str):
        raise ModelsError("the holder shares a module, which needs torch and a loader function")
    with torch.device("meta"):
        module = loader()
    if not _is_module(module):
        raise ModelsError("the loader no longer returns a module")
    for dotted, _ in list(_named_tensors(module)):
        if dotted not in slots:
            raise ModelsError(f"the holder's layout has no tensor {dotted!r}")
        _set_tensor(module, dotted, _torch_view(flat, slots[dotted]))
    return module.eval()


def reset() -> None:
    """Forget every model of this process (tests; a process serves one function for its life)."""
    with _lock:
        for model in _models.values():
            if model.holder is not None:
                model.holder.close()
            if model.link is not None:
                with contextlib.suppress(OSError):
                    model.link.close()
        _models.clear()
