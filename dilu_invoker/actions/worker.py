"""The worker process: loads the user's action once and runs it for every /run (stdlib only).

The proxy (`runtime.py`) starts one worker ahead of time and talks to it over a Unix socket (fd given on
the command line). The worker's stdout and stderr are the proxy's, so the user's output goes straight to
the container's streams; the worker writes the activation sentinel on both after the user's output of each
run and of a failed init. Anything fatal here (a segfault, `os._exit`, `sys.exit`) ends only this process;
the proxy notices and answers for it.

A pre-loaded worker (the invoker's pool of pre-loaded containers, docs/runtime.md "Pre-loaded workers")
imports the modules named in ``DILU_PRELOAD_MODULES`` and, with ``DILU_PRELOAD_CUDA=1``, creates its CUDA
context before it reads its first frame (an MPS client: at the thread cap of its environment, which an
/init then may not change); the proxy learns the outcome from one ``PRELOADED`` frame. The
action it later loads still gets a fresh module of its own: only the imported libraries are shared, and
the process serves that one action for the rest of its life.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import functools
import glob
import importlib
import io
import json
import os
import select
import site
import socket
import sys
import threading
import time
import traceback
import zipfile
from collections.abc import Callable
from typing import Any

from dilu_invoker.actions._ipc import (
    ESCAPED_SENTINEL,
    SENTINEL,
    SENTINEL_LINE,
    WELCOME_BLOB,
    Kind,
    die_with_parent,
    frame_chunks,
    installed_roots,
    json_default,
    pack_stage,
    put_blob,
    read_frame,
    take_blob,
    unpack_stage,
)

MODULE_NAME = "main__"
PRELOAD_MODULES_ENV = "DILU_PRELOAD_MODULES"
PRELOAD_CUDA_ENV = "DILU_PRELOAD_CUDA"
#: at most this many imported module names are reported after an /init (what the invoker learns from)
MAX_REPORTED_IMPORTS = 32
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
#: CUDA_ERROR_NO_DEVICE: no GPU visible, as torch.cuda.is_available() False (no context, no error)
_CUDA_ERROR_NO_DEVICE = 100


class InitFailure(Exception):
    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Worker:
    def __init__(self, sock: socket.socket, *, action_dir: str, concurrent: bool,
                 direct: socket.socket | None = None) -> None:
        self._sock = sock
        #: the direct lane to the invoker (runs only), or None
        self._direct = direct
        self._send_lock = threading.Lock()
        self._direct_lock = threading.Lock()
        self._env_lock = threading.Lock()
        self._action_dir = action_dir
        self._concurrent = concurrent
        self._main: Callable[[Any], Any] | None = None
        #: top-level installed modules the action's module imported (reported with INIT_OK)
        self.imports: list[str] = []
        #: sys.modules before the action's module was imported; None once the first run's imports were reported
        self._before_init: set[str] | None = None
        #: the MPS thread cap (percent, as in the environment) a pre-loaded CUDA context was made at
        self.context_cap: str | None = None

    # -- wire ---------------------------------------------------------------------------------------

    def _send(self, kind: Kind, request_id: int, payload: bytes | list[bytes] = b"") -> None:
        frame = b"".join(frame_chunks(kind, request_id, payload))
        with self._send_lock:
            self._sock.sendall(frame)

    def _send_direct(self, kind: Kind, request_id: int, payload: bytes | list[bytes] = b"") -> None:
        assert self._direct is not None
        with contextlib.suppress(OSError), self._direct_lock:  # the invoker went away: nobody to answer
            for chunk in frame_chunks(kind, request_id, payload):
                self._direct.sendall(chunk)

    def serve(self) -> None:
        channels = [self._sock] if self._direct is None else [self._sock, self._direct]
        while True:
            # Frames are read unbuffered (`read_frame`), so a socket with nothing readable has no frame waiting.
            ready = [self._sock] if len(channels) == 1 else select.select(channels, [], [])[0]
            for channel in ready:
                frame = read_frame(channel)
                if frame is None and channel is self._sock:
                    # The proxy is gone: nobody can use our answers any more.
                    _flush_streams()
                    os._exit(0)
                if frame is None:
                    # The invoker closed the lane (it keeps using the proxy's /run).
                    channels.remove(channel)
                    continue
                self._dispatch(*frame, direct=channel is not self._sock)

    def _dispatch(self, kind: int, request_id: int, payload: bytes, *, direct: bool) -> None:
        if kind == Kind.INIT and not direct:
            self._handle_init(request_id, payload)
        elif kind in (Kind.RUN, Kind.RUN_STAGE):
            if direct:
                # The proxy counts it, so that if this process dies meanwhile the run's logs still end.
                self._send(Kind.DIRECT_BEGIN, request_id)
            if self._concurrent:
                threading.Thread(target=self._handle_run, args=(request_id, payload, direct, kind == Kind.RUN_STAGE),
                                 daemon=True).start()
            else:
                self._handle_run(request_id, payload, direct, kind == Kind.RUN_STAGE)

    # -- /init --------------------------------------------------------------------------------------

    def _handle_init(self, request_id: int, payload: bytes) -> None:
        try:
            self._main = self._load(payload)
        except InitFailure as failure:
            sys.stderr.write(f"{failure}\n")
            _end_activation_output()
            self._send(failure.kind, request_id, str(failure).encode("utf-8", "replace"))
            return
        except SystemExit as exc:
            _exit_like_python(exc)
        except BaseException:  # noqa: BLE001 - anything the user's module does at import is its own failure
            traceback.print_exc(file=sys.stderr)
            _end_activation_output()
            self._send(Kind.INIT_START_ERROR, request_id, b"the action's module failed to load")
            return
        held = held_models()
        if held:
            self._send(Kind.HELD_MODELS, 0, json.dumps(held).encode())
        self._send(Kind.INIT_OK, request_id, json.dumps(self.imports).encode())

    def _load(self, payload: bytes) -> Callable[[Any], Any]:
        value = json.loads(payload)["value"]
        cap = (value.get("env") or {}).get(MPS_THREADS_ENV)
        if self.context_cap is not None and cap is not None and _env_string(cap) != self.context_cap:
            # The cap is fixed with the context: this process cannot run the function at its own cap.
            raise InitFailure(Kind.INIT_START_ERROR, f"this container's CUDA context has MPS thread cap "
                                                     f"{self.context_cap}%, not the function's {cap}%")
        for key, raw in (value.get("env") or {}).items():
            os.environ[str(key)] = _env_string(raw)
        main_name = value.get("main") or "main"
        code = value["code"]
        module_path = os.path.join(self._action_dir, MODULE_NAME + ".py")
        if value.get("binary"):
            archive = _decode_base64(code)
            _extract_zip(archive, self._action_dir)
            entry = os.path.join(self._action_dir, "__main__.py")
            if not os.path.isfile(entry):
                raise InitFailure(Kind.INIT_COMPILE_ERROR, "Zip file does not include __main__.py")
            os.replace(entry, module_path)
        else:
            with open(module_path, "w", encoding="utf-8") as handle:
                handle.write(code)
        with open(module_path, "rb") as handle:
            source = handle.read()
        try:
            compile(source, module_path, "exec")
        except (SyntaxError, ValueError) as exc:
            text = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")
            raise InitFailure(Kind.INIT_COMPILE_ERROR, text) from None

        os.chdir(self._action_dir)
        sys.path.insert(0, self._action_dir)
        # After the action dir, as upstream: the virtualenv's packages end up in front of it.
        _activate_virtualenv(os.path.join(self._action_dir, "virtualenv"))
        before = set(sys.modules)
        module = importlib.import_module(MODULE_NAME)
        main = getattr(module, main_name, None)
        if not callable(main):
            raise InitFailure(Kind.INIT_START_ERROR, f"The action has no function named '{main_name}'.")
        self.imports = installed_imports(before, self._action_dir)
        self._before_init = before
        return main

    # -- /run ---------------------------------------------------------------------------------------

    def _handle_run(self, request_id: int, payload: bytes, direct: bool = False, staged: bool = False) -> None:
        """One run: a RUN frame's body, or (`staged`) a RUN_STAGE frame's: the body, the previous stage's tensor
        bytes put back at `value.dilu_stage.data`, and whether a RESULT_STAGE answer is welcome."""
        reply = self._send_direct if direct else self._send
        if self._main is None:  # a lane used before /init (not by the invoker): answered as the proxy would
            reply(Kind.BAD_REQUEST, request_id, b"no action defined yet")
            if direct:
                self._send(Kind.DIRECT_END, request_id)
            return
        welcome = False
        try:
            blob = None
            if staged:
                payload, blob, flags = unpack_stage(payload)
                welcome = bool(flags & WELCOME_BLOB)
            body = json.loads(payload)
            if not isinstance(body, dict):
                raise TypeError("the run body is not a JSON object")
            if blob is not None:
                put_blob(body.get("value"), blob)
        except (ValueError, TypeError) as exc:
            _end_activation_output()
            reply(Kind.BAD_REQUEST, request_id, str(exc).encode())
            if direct:
                self._send(Kind.DIRECT_END, request_id)
            return
        args = body.get("value", {})
        # Process-wide, as in the upstream launcher: with concurrent runs the last one to start wins.
        with self._env_lock:
            environ = os.environ
            for key, raw in body.items():
                if key != "value":
                    name, text = f"__OW_{key.upper()}", _env_string(raw)
                    if environ.get(name) != text:  # most (namespace, action name, version) repeat every run
                        environ[name] = text
        try:
            result = self._main(args)
        except SystemExit as exc:
            _exit_like_python(exc)
        except BaseException as exc:  # noqa: BLE001 - the action's failure becomes its error result
            _print_user_traceback(exc)
            result = {"error": str(exc)}
        kind, out = _encode_result(result, welcome)
        _end_activation_output()
        self._report_run_imports()
        reply(kind, request_id, out)
        if direct:
            self._send(Kind.DIRECT_END, request_id)

    def _report_run_imports(self) -> None:
        """Once, after the first run: the installed modules it imported first (a `main` that imports its
        libraries lazily), sent before its result so the proxy knows them when the invoker asks."""
        before, self._before_init = self._before_init, None
        if before is None:
            return
        try:
            late = [name for name in installed_imports(before, self._action_dir) if name not in self.imports]
        except RuntimeError:  # sys.modules changed under a concurrent run: nothing reported
            return
        if late:
            self._send(Kind.RUN_IMPORTS, 0, json.dumps(late).encode())


def held_models() -> list[str]:
    """The models this process serves to other instances as their holder (`dilu_invoker.actions.models`;
    nothing when the action never imported it)."""
    api = sys.modules.get("dilu_invoker.actions.models")
    if api is None:
        return []
    return sorted(name for name, model in list(api._models.items()) if model.role == "holder")


def installed_imports(before: set[str], action_dir: str) -> list[str]:
    """Top-level modules imported since ``before`` that are installed packages (site-packages), not the
    action's own files nor its virtualenv: what a pre-loaded worker of the kind could import ahead. The
    packages the action imported itself come first: importlib moves a module to the end of ``sys.modules``
    once it has finished loading, so a package ends after every dependency it pulled in, and the newest
    finished are read first (``import transformers`` reports ``transformers`` before the dozens it imports,
    which the bounded list would otherwise cut it from)."""
    roots = installed_roots()
    own = os.path.realpath(action_dir) + os.sep
    names: list[str] = []
    seen: set[str] = set()
    for name in reversed(list(sys.modules)):
        if name in before:
            continue
        top = name.partition(".")[0]
        if top in seen:
            continue
        seen.add(top)
        if top == MODULE_NAME or top.startswith("_") or not top.isidentifier():
            continue
        module = sys.modules.get(top)
        path = getattr(module, "__file__", None)
        if not path:
            continue
        real = os.path.realpath(path)
        if real.startswith(own) or not real.startswith(roots):
            continue
        names.append(top)
        if len(names) >= MAX_REPORTED_IMPORTS:
            break
    return names


def preload(modules: list[str], *, cuda: bool) -> dict[str, Any]:
    """Import ``modules`` (missing ones are tolerated and reported) and, with ``cuda``, create the CUDA
    context through the first of torch/cupy that imported, else through the driver (libcuda: ``DILU_LIBCUDA``
    or ``libcuda.so.1``; skipped when there is none or no GPU is visible). Returns what happened; under MPS
    ``mps_threads`` is the thread cap the context was made at; ``cuda_error`` set means the process must not
    serve (the invoker discards it)."""
    started = time.monotonic()
    loaded: list[str] = []
    missing: list[str] = []
    for name in modules:
        if not all(part.isidentifier() for part in name.split(".")):
            missing.append(name)
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a library that does not import is simply not pre-loaded
            missing.append(name)
        else:
            loaded.append(name)
    info: dict[str, Any] = {"modules": loaded, "missing": missing, "cuda": False, "cuda_error": None,
                            "mps_threads": None}
    if cuda:
        try:
            info["cuda"] = _create_cuda_context()
        except BaseException as exc:  # noqa: BLE001 - reported; the invoker discards the process
            info["cuda_error"] = f"{type(exc).__name__}: {exc}"
        if info["cuda"] and MPS_PIPE_ENV in os.environ:
            info["mps_threads"] = os.environ.get(MPS_THREADS_ENV)
    info["ms"] = int((time.monotonic() - started) * 1000)
    return info


def _create_cuda_context() -> bool:
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return False
        torch.cuda.init()
        torch.empty(1, device="cuda")  # a tiny allocation: the primary context and the allocator exist now
        _warm_torch_libraries(torch)
        try:
            _warm_torch_layers(torch)
        except torch.cuda.OutOfMemoryError:  # a small GPU memory cap: the layers load on first use instead
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        return True
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        cupy.zeros(1)
        cupy.cuda.runtime.deviceSynchronize()
        return True
    return _create_driver_context()


def _create_driver_context() -> bool:
    """The device's primary context through the driver API — the one torch and cupy use when the action
    imports them — for a kind whose pre-load list has neither (or where they did not import)."""
    try:
        lib = ctypes.CDLL(os.environ.get("DILU_LIBCUDA", "libcuda.so.1"))
    except OSError:
        return False  # no driver on this node: nothing to create

    def check(what: str, err: int) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed with CUDA error {err}")

    rc = lib.cuInit(0)
    if rc == _CUDA_ERROR_NO_DEVICE:
        return False
    check("cuInit", rc)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), 0))
    check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
    return True


def _warm_torch_libraries(torch: Any) -> None:
    """Load the GPU libraries a first request would otherwise load inside the function's /init or first
    run — cuBLAS and cuDNN handles, their first kernels, in fp16 and fp32 — with a few tiny launches
    (the placeholder's small share is plenty for them); the allocator's blocks go back afterwards."""
    functional = torch.nn.functional
    with torch.no_grad():
        for dtype in (torch.float16, torch.float32):
            a = torch.ones((64, 64), device="cuda", dtype=dtype)
            (a @ a).sum()
            if torch.backends.cudnn.is_available():
                x = torch.ones((1, 8, 16, 16), device="cuda", dtype=dtype)
                w = torch.ones((8, 8, 3, 3), device="cuda", dtype=dtype)
                functional.relu(functional.conv2d(x, w, padding=1))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _warm_torch_layers(torch: Any) -> None:
    """Run the common layers of vision and language models once, at the sizes they usually run at (batch 8;
    convolutions 1x1, 3x3 and 7x7 at strides 1 and 2 over 64-2048 channels and 7-112 pixels, as ImageNet CNNs
    have them; batch norm, pooling, linear, layer norm, softmax, GELU, attention, embedding), in fp16 and
    fp32: with lazy module loading each kernel is loaded on its first launch, and cuDNN picks its kernels by
    shape, so a few tiny launches (`_warm_torch_libraries`) leave most of a first inference's loading to the
    request. On the H200 a mapped ResNet-50's first inference (batch 8, fp16) took 80-87 ms after this
    against 169-204 ms after the tiny launches alone and 323-959 ms after none; the warm-up took 0.6-1.0 s
    in the pre-loaded process and kept 88 MiB more GPU memory (cuDNN and cuBLAS state, loaded kernels)
    (`bench/h200_first_infer.sh`, docs/benchmarks/coldstart.md)."""
    functional = torch.nn.functional
    convs = ((3, 64, 7, 2, 112), (64, 64, 1, 1, 56), (64, 64, 3, 1, 56), (64, 256, 1, 1, 56), (128, 128, 3, 2, 56),
             (128, 512, 1, 1, 28), (256, 256, 3, 2, 28), (256, 1024, 1, 1, 14), (512, 512, 3, 2, 14),
             (512, 2048, 1, 1, 7), (256, 512, 1, 2, 28))
    with torch.inference_mode():
        for dtype in (torch.float16, torch.float32):
            for cin, cout, k, stride, size in convs:
                x = torch.ones((8, cin, size, size), device="cuda", dtype=dtype)
                w = torch.ones((cout, cin, k, k), device="cuda", dtype=dtype)
                y = functional.conv2d(x, w, stride=stride, padding=k // 2)
                ones = torch.ones(cout, device="cuda", dtype=dtype)
                y = functional.relu(functional.batch_norm(y, ones, ones, ones, ones, training=False))
                (y + y).sum()
            x = torch.ones((8, 64, 112, 112), device="cuda", dtype=dtype)
            functional.max_pool2d(x, 3, 2, 1)
            functional.adaptive_avg_pool2d(x, 1).flatten(1)
            for n in (768, 2048):
                a = torch.ones((8 * 128, n), device="cuda", dtype=dtype)
                lin = torch.ones((n, n), device="cuda", dtype=dtype)
                y = functional.linear(a, lin, torch.ones(n, device="cuda", dtype=dtype))
                y = functional.gelu(functional.layer_norm(y, (n,)))
                functional.softmax(y, dim=-1).sum()
            q = torch.ones((8, 12, 128, 64), device="cuda", dtype=dtype)
            functional.scaled_dot_product_attention(q, q, q).sum()
            functional.embedding(torch.zeros((8, 128), device="cuda", dtype=torch.long),
                                 torch.ones((30522, 768), device="cuda", dtype=dtype)).sum()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _print_user_traceback(exc: BaseException) -> None:
    # Skip this module's frame: the user should see their own code first, as with the upstream launcher.
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _encode_result(result: Any, welcome_blob: bool = False) -> tuple[Kind, bytes | list[bytes]]:
    """The answer frame's kind and payload. A `Blob` (`pipeline.send`'s tensor bytes) is base64 in the JSON, except
    that where a stage frame is welcome (`welcome_blob`) the one at `dilu_stage.data` goes as the frame's blob."""
    if not isinstance(result, (dict, list, tuple)):
        return Kind.RESULT_NOT_DICT, b""
    blob = None
    if welcome_blob:
        result, blob = take_blob(result)
    try:
        text = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=json_default)
    except (TypeError, ValueError, RecursionError) as exc:
        return Kind.RESULT_NOT_JSON, f"The action returned a result that is not valid JSON: {exc}".encode()
    if blob is not None:
        return Kind.RESULT_STAGE, pack_stage(text.encode("utf-8", "surrogatepass"), blob)
    return Kind.RESULT, text.encode("utf-8", "surrogatepass")


def _env_string(raw: Any) -> str:
    return raw if isinstance(raw, str) else json.dumps(raw)


def _decode_base64(code: Any) -> bytes:
    if not isinstance(code, str):
        raise InitFailure(Kind.INIT_DECODE_ERROR, "cannot decode the request: binary code is not a string")
    try:
        return base64.b64decode(code.replace("\n", "").replace("\r", ""), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InitFailure(Kind.INIT_DECODE_ERROR, f"cannot decode the request: {exc}") from None


def _extract_zip(archive: bytes, target: str) -> None:
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as bundle:
            # extractall drops absolute paths and '..' parts, so nothing lands outside the action dir.
            bundle.extractall(target)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise InitFailure(Kind.INIT_COMPILE_ERROR, f"The binary code is not a usable zip file: {exc}") from None


def _activate_virtualenv(venv: str) -> None:
    """Honour a `virtualenv/` shipped in the zip, as the upstream launcher does.

    Upstream executes `virtualenv/bin/activate_this.py` (written by the `virtualenv` tool). A venv made by
    `python -m venv` has no such file; instead of refusing it, add its site-packages directories.
    """
    if not os.path.isdir(venv):
        return
    for candidate in ("bin/activate_this.py", "Scripts/activate_this.py"):
        activate = os.path.join(venv, candidate)
        if os.path.exists(activate):
            with open(activate, encoding="utf-8") as handle:
                code = compile(handle.read(), activate, "exec")
            exec(code, {"__file__": activate})
            return
    site_dirs = sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages")))
    if not site_dirs:
        raise InitFailure(Kind.INIT_START_ERROR, "Invalid virtualenv. Zip file does not include 'activate_this.py'.")

    for site_dir in site_dirs:
        site.addsitedir(site_dir)
    # addsitedir appends; the action's packages must win over the image's, as with activate_this.py.
    for site_dir in reversed(site_dirs):
        sys.path.remove(site_dir)
        sys.path.insert(0, site_dir)
    os.environ["VIRTUAL_ENV"] = venv


@functools.cache
def _libc_fflush() -> Any:
    """libc's ``fflush``, looked up once (opening the C library for every activation cost ~20 µs)."""
    return ctypes.CDLL(None).fflush


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        # A closed or replaced stream must not stop the sentinel.
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    # Output of C extensions sits in libc's stdio buffers, which Python's flush does not reach.
    with contextlib.suppress(Exception):
        _libc_fflush()(None)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


class SentinelEscapingStream:
    """``sys.stdout``/``sys.stderr`` of the action: the activation sentinel in the action's own output is
    written as :data:`ESCAPED_SENTINEL`, so printing it cannot end this activation's logs early nor move
    the rest into the next activation's record. A write that ends with the start of the sentinel keeps that
    part back until the next write shows whether the sentinel is completed (or until the activation ends).

    Only Python-level writes pass through here; bytes written to the file descriptors directly
    (``os.write(1, ...)``, C extensions, ``sys.stdout.buffer``) are not escaped."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._held = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            data = self._held + text
            self._held = ""
            if SENTINEL in data:
                data = data.replace(SENTINEL, ESCAPED_SENTINEL)
            # Keep back the longest tail that could still grow into the sentinel.
            for k in range(min(len(SENTINEL) - 1, len(data)), 0, -1):
                if SENTINEL.startswith(data[-k:]):
                    self._held, data = data[-k:], data[:-k]
                    break
            if data:
                self._stream.write(data)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def release(self) -> None:
        """End of the activation's output: what was kept back is plain text after all."""
        with self._lock:
            held, self._held = self._held, ""
            if held:
                self._stream.write(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _install_sentinel_escaping() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SentinelEscapingStream):
            setattr(sys, name, SentinelEscapingStream(stream))


def _end_activation_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, SentinelEscapingStream):
            with contextlib.suppress(Exception):
                stream.release()
    _flush_streams()
    _write_all(1, SENTINEL_LINE)
    _write_all(2, SENTINEL_LINE)


def _exit_like_python(exc: SystemExit) -> None:
    """`sys.exit()` inside an action ends the worker (as upstream), from any thread."""
    code = exc.code
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        sys.stderr.write(f"{code}\n")
        status = 1
    _flush_streams()
    os._exit(status)


def main(argv: list[str]) -> int:
    fd, action_dir, concurrent, parent = int(argv[0]), argv[1], argv[2] == "1", int(argv[3])
    die_with_parent(parent)  # (not Linux: the socket's EOF still ends an idle worker)
    sock = socket.socket(fileno=fd)
    direct = socket.socket(fileno=int(argv[4])) if len(argv) > 4 else None
    asked = PRELOAD_MODULES_ENV in os.environ or PRELOAD_CUDA_ENV in os.environ
    modules = [m.strip() for m in os.environ.pop(PRELOAD_MODULES_ENV, "").split(",") if m.strip()]
    cuda = os.environ.pop(PRELOAD_CUDA_ENV, "") == "1"
    worker = Worker(sock, action_dir=action_dir, concurrent=concurrent, direct=direct)
    if asked:
        info = preload(modules, cuda=cuda)
        worker.context_cap = info.get("mps_threads")
        # Whatever the libraries printed while importing is not any activation's output.
        _flush_streams()
        worker._send(Kind.PRELOADED, 0, json.dumps(info).encode())
    _install_sentinel_escaping()
    worker.serve()
    return 0
