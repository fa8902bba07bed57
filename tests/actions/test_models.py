"""The models API on the CPU paths, with real processes: the parallel loader, the handle exchange between
instances of one function, its access control, and the fallback when the holder dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

from dilu_invoker.actions import models  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("models_child.py")


@pytest.fixture(autouse=True)
def _fresh() -> None:
    models.reset()
    models.drop_host_cache()
    yield
    models.reset()


def _weights(tmp_path: Path) -> tuple[str, dict[str, object]]:
    rng = np.random.default_rng(7)
    tensors = {"w": rng.standard_normal((300, 257)).astype(np.float16),
               "b": np.arange(1001, dtype=np.int64), "scale": np.float32([3.5])}
    path = str(tmp_path / "m.safetensors")
    models.save_file(path, tensors)
    return path, tensors


def test_parallel_read_matches_file_and_plain_path(tmp_path: Path) -> None:
    path, tensors = _weights(tmp_path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    # Small chunks and several threads: pieces are dealt round-robin, so every thread reads several.
    w = models.read_weights(path, device="cpu", threads=4, chunk_bytes=4096)
    plain = models.plain_read(path, device="cpu")
    assert w.device == "cpu" and w.threads == 4 and w.nbytes == sum(a.nbytes for a in tensors.values())
    for name, arr in tensors.items():
        assert w.tensors[name].dtype == arr.dtype and w.tensors[name].shape == arr.shape
        assert np.array_equal(w.tensors[name], arr)
        assert np.array_equal(plain.tensors[name], arr)


def test_bad_files_get_clear_errors(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    with pytest.raises(models.ModelsError, match="shorter than 8 bytes"):
        models.read_weights(str(short), device="cpu")
    lying = tmp_path / "lying"
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    lying.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(models.ModelsError, match="inconsistent byte range"):
        models.read_weights(str(lying), device="cpu")
    if not models._cuda_available():
        good, _ = _weights(tmp_path)
        with pytest.raises(models.ModelsError, match="CUDA is not available"):
            models.read_weights(good, device="cuda")


def test_without_a_key_nothing_is_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, tensors = _weights(tmp_path)
    monkeypatch.delenv(models.ENV_KEY, raising=False)
    value = models.load("m", path, device="cpu")
    again = models.load("m", path, device="cpu")
    assert again is value
    info = models.info("m")
    assert info is not None and info.role == "local" and info.holder is None
    assert np.array_equal(value["w"], tensors["w"])


class Instance:
    """One instance of a function: a real process that loads the model and answers on stdin."""

    def __init__(self, path: str, key: str, name: str = "m") -> None:
        env = {**os.environ, models.ENV_KEY: key, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(CHILD), name, path], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def state(self, command: str | None = None) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"instance exited with {self.proc.wait()}"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def instances():
    made: list[Instance] = []

    def make(*args: str) -> Instance:
        made.append(Instance(*args))
        return made[-1]

    yield make
    for inst in made:
        inst.stop()


def test_second_instance_maps_the_holders_memory(tmp_path: Path, instances) -> None:
    path, _ = _weights(tmp_path)
    first = instances(path, "key-of-fn-a")
    a = first.state()
    assert a["role"] == "holder"
    second = instances(path, "key-of-fn-a")
    b = second.state()
    assert b["role"] == "mapped" and b["nbytes"] == a["nbytes"] and b["sum"] == a["sum"]
    assert first.state("info")["served"] == 1
    # A write in the holder's copy shows in the mapper: one copy of the weights, not two.
    first.state("set 1234")
    assert second.state("info")["first"] == 1234.0


def test_another_function_cannot_obtain_the_handle(tmp_path: Path, instances) -> None:
    path, _ = _weights(tmp_path)
    holder = instances(path, "key-of-fn-a")
    assert holder.state()["role"] == "holder"
    address = models.endpoint(b"key-of-fn-a", "m", "cpu")
    # Function b knows the address (abstract sockets are listed in /proc/net/unix) but not a's key.
    with pytest.raises(PermissionError):
        models.fetch(b"key-of-fn-b", address)
    assert holder.state("info")["refused"] == 1
    # Function b's own instances use their own endpoint: they load themselves and never see a's memory.
    other = instances(path, "key-of-fn-b")
    state = other.state()
    assert state["role"] == "holder"
    assert holder.state("info")["served"] == 0


def test_an_impostor_holder_is_not_believed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, tensors = _weights(tmp_path)
    address = models.endpoint(b"key-of-fn-a", "m", "cpu")
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(address)  # squats function a's endpoint without its key
    fake.listen(1)

    def serve() -> None:
        conn, _ = fake.accept()
        conn.sendall(b"dilu-models/1" + b"\0" * 32)
        conn.recv(64)
        conn.sendall(b"\1" * 32 + (2).to_bytes(4, "big") + b"{}")
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    monkeypatch.setenv(models.ENV_KEY, "key-of-fn-a")
    try:
        value = models.load("m", path, device="cpu")
    finally:
        fake.close()
    t.join(5)
    info = models.info("m")
    assert info is not None and info.role == "local" and "could not prove" in info.reason
    assert np.array_equal(value["w"], tensors["w"])


def test_when_the_holder_dies_the_mapper_loads_itself_and_takes_over(tmp_path: Path, instances) -> None:
    path, tensors = _weights(tmp_path)
    holder = instances(path, "key-of-fn-a")
    assert holder.state()["role"] == "holder"
    mapper = instances(path, "key-of-fn-a")
    assert mapper.state()["role"] == "mapped"
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait()
    deadline = time.monotonic() + 5
    while True:
        state = mapper.state("info")
        if state["role"] == "holder" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert state["role"] == "holder" and state["reloads"] == 1
    assert state["sum"] == float(tensors["w"].sum())
    # A new instance now maps from the one that took over.
    third = instances(path, "key-of-fn-a")
    assert third.state()["role"] == "mapped"
    assert mapper.state("info")["served"] == 1


def test_derived_keys_differ_per_function_and_revision() -> None:
    secret = b"s" * 32
    a = models.derive_key(secret, "ns", "a", "1")
    assert a == models.derive_key(secret, "ns", "a", "1")
    assert len({a, models.derive_key(secret, "ns", "b", "1"), models.derive_key(secret, "ns", "a", "2"),
                models.derive_key(b"t" * 32, "ns", "a", "1")}) == 4


def test_the_invokers_key_is_the_one_the_runtime_expects() -> None:
    from dilu_invoker.invoker.dataplane.runtime_client import MODELS_KEY_ENV, models_key

    assert MODELS_KEY_ENV == models.ENV_KEY
    assert models_key(b"k" * 32, "guest", "fn", "3") == models.derive_key(b"k" * 32, "guest", "fn", "3")
