"""A profiler worker: one process that loads models on one GPU and times batches on request.

Started by `dilu-invoker profile` (dilu_invoker/sim/profiler.py), never by hand. The SM share is set
from outside: by MPS (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, fixed when the CUDA context is created, so
one worker per share) or by the shim's control block (changeable at run time). Protocol: one JSON
object per line on stdin, one JSON reply per line on stdout; logs go to stderr.

    {"op": "info"}                                     -> {"ok": true, "device": ..., "torch": ...}
    {"op": "load", "model": "resnet50"}                -> {"ok": true, "param_mib": ...}
    {"op": "measure", "model": "resnet50", "batch": 8, "share": 0.3,
     "warmup": 3, "min_iters": 5, "max_iters": 50, "min_time_s": 0.25}
                                                       -> {"ok": true, "latency_ms": ..., "latency_p90_ms": ...,
                                                           "throughput_rps": ..., "iters": ..., "memory_mib": ...}
    {"op": "quit"}

Models: `resnet50` (torchvision, random weights), `bert-base` (transformers BertModel(BertConfig()),
random weights, sequence length 128), `train-resnet50` (one SGD step of resnet50 on random data),
`action:PATH` (an OpenWhisk action file whose `main(params)` is called with {"batch": b}), and
`formula:NAME` (no GPU: the synthetic latency formula of the simulator's test fixture, honouring the
requested share; for dry runs of the profiler's plumbing only — its output is labelled synthetic).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, ClassVar

SEQ_LEN = 128
CONTEXT_OVERHEAD_MIB = 600.0
"""Added to a model's own peak allocation: the CUDA context and allocator slack per instance."""


class _Formula:
    """latency = overhead + (w0 + w1·b) / min(1, share / min(1, s0 + k·b)), slept for real."""

    PARAMS: ClassVar[dict[str, tuple[float, float, float, float, float]]] = {
        "resnet50": (0.8, 2.5, 0.45, 0.12, 0.03),
        "bert-base": (1.0, 3.5, 1.1, 0.15, 0.05),
        "train-resnet50": (2.0, 8.0, 1.5, 0.25, 0.03),
    }

    def __init__(self, name: str, scale: float) -> None:
        if name not in self.PARAMS:
            raise ValueError(f"no formula for {name!r}; known: {sorted(self.PARAMS)}")
        self.params = self.PARAMS[name]
        self.scale = scale
        self._launch: Any = None

    FAKE_LAUNCHES_ENV = "DILU_PROFILE_FAKE_LAUNCHES"
    """Set (tests only, with the fake libcuda and the shim preloaded): each step also launches kernels
    through libcuda.so.1 and the formula ignores the requested share — the shim holds it instead."""

    def run(self, batch: int, share: float) -> None:
        overhead, w0, w1, s0, k = self.params
        if self.launch is not None:
            # The GPU time of the whole-GPU formula, in four slices each ending with a launch of
            # 64 blocks per sample: under a share the shim makes the launches wait for tokens.
            slice_s = (overhead + w0 + w1 * batch) * self.scale / 1000.0 / 4
            for _ in range(4):
                time.sleep(slice_s)
                self.launch(None, 64 * batch, 1, 1, 1, 1, 1, 0, 0x100, None, None)
            return
        sat = min(1.0, s0 + k * batch)
        ms = overhead + (w0 + w1 * batch) / min(1.0, max(share, 1e-3) / sat)
        time.sleep(ms * self.scale / 1000.0)

    @property
    def launch(self) -> Any:
        if not os.environ.get(self.FAKE_LAUNCHES_ENV):
            return None
        if self._launch is None:
            import ctypes

            cuda = ctypes.CDLL("libcuda.so.1")
            fn = cuda.cuLaunchKernel
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            cuda.cuInit(0)
            self._launch = fn
        return self._launch


class Worker:
    def __init__(self, device: int, dtype: str, formula_scale: float) -> None:
        self.device = device
        self.dtype_name = dtype
        self.formula_scale = formula_scale
        self.models: dict[str, Any] = {}
        self.inputs: dict[tuple[str, int], Any] = {}
        self.param_bytes: dict[str, int] = {}
        self._torch: Any = None

    # -- torch, lazily: a formula worker never imports it ------------------------------------

    @property
    def torch(self) -> Any:
        if self._torch is None:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device visible to torch")
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = False
            self._torch = torch
        return self._torch

    def _dtype(self, training: bool) -> Any:
        if training or self.dtype_name == "float32":
            return self.torch.float32
        return self.torch.float16

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"python": sys.version.split()[0]}
        try:
            torch = self.torch
        except (ImportError, RuntimeError) as exc:
            out["torch"] = None
            out["error"] = str(exc)
            return out
        props = torch.cuda.get_device_properties(self.device)
        out.update(
            {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "device": props.name,
                "sm_count": props.multi_processor_count,
                "memory_mib": props.total_memory / 2**20,
            }
        )
        return out

    def load(self, model: str) -> dict[str, Any]:
        if model in self.models:
            return {"param_mib": self.param_bytes.get(model, 0) / 2**20}
        if model.startswith("formula:"):
            self.models[model] = _Formula(model.split(":", 1)[1], self.formula_scale)
            return {"param_mib": 0.0}
        if model.startswith("action:"):
            path = model.split(":", 1)[1]
            spec = importlib.util.spec_from_file_location("dilu_profiled_action", path)
            if spec is None or spec.loader is None:
                raise ValueError(f"cannot load action file {path}")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            if not callable(getattr(mod, "main", None)):
                raise ValueError(f"{path} has no main(params) function")
            self.models[model] = mod
            return {"param_mib": 0.0}
        torch = self.torch
        dev = torch.device("cuda", self.device)
        before = torch.cuda.memory_allocated(dev)
        if model in ("resnet50", "train-resnet50"):
            import torchvision

            net = torchvision.models.resnet50(weights=None)
        elif model == "bert-base":
            import transformers

            net = transformers.BertModel(transformers.BertConfig())
        else:
            raise ValueError(f"unknown model {model!r}")
        training = model.startswith("train-")
        net = net.to(dev, dtype=self._dtype(training))
        if training:
            net.train()
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            self.models[model] = (net, opt)
        else:
            net.eval()
            self.models[model] = (net, None)
        self.param_bytes[model] = torch.cuda.memory_allocated(dev) - before
        return {"param_mib": self.param_bytes[model] / 2**20}

    def _input(self, model: str, batch: int) -> Any:
        key = (model, batch)
        if key not in self.inputs:
            torch = self.torch
            dev = torch.device("cuda", self.device)
            if model == "bert-base":
                x = torch.randint(0, 30000, (batch, SEQ_LEN), device=dev)
                self.inputs[key] = (x, None)
            else:
                training = model.startswith("train-")
                x = torch.randn(batch, 3, 224, 224, device=dev, dtype=self._dtype(training))
                y = torch.randint(0, 1000, (batch,), device=dev) if training else None
                self.inputs[key] = (x, y)
        return self.inputs[key]

    def _step(self, model: str, batch: int, share: float) -> None:
        m = self.models[model]
        if model.startswith("formula:"):
            m.run(batch, share)
            return
        if model.startswith("action:"):
            m.main({"batch": batch})
            if self._torch is not None or "torch" in sys.modules:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            return
        torch = self.torch
        net, opt = m
        x, y = self._input(model, batch)
        if opt is None:
            with torch.inference_mode():
                net(x)
        else:
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def measure(self, req: dict[str, Any]) -> dict[str, Any]:
        model = str(req["model"])
        batch = int(req["batch"])
        share = float(req.get("share", 1.0))
        self.load(model)
        gpu = not model.startswith(("formula:", "action:"))
        if gpu:
            torch = self.torch
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(int(req.get("warmup", 3))):
            self._step(model, batch, share)
        times: list[float] = []
        min_iters = int(req.get("min_iters", 5))
        max_iters = int(req.get("max_iters", 50))
        min_time = float(req.get("min_time_s", 0.25))
        start = time.perf_counter()
        while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start < min_time):
            t0 = time.perf_counter()
            self._step(model, batch, share)
            times.append(time.perf_counter() - t0)
        lat = statistics.median(times)
        out: dict[str, Any] = {
            "latency_ms": lat * 1000.0,
            "latency_p90_ms": sorted(times)[min(len(times) - 1, int(0.9 * len(times)))] * 1000.0,
            "throughput_rps": batch / (sum(times) / len(times)),
            "iters": len(times),
        }
        if gpu:
            peak = torch.cuda.max_memory_allocated()
            own = peak - base + self.param_bytes.get(model, 0)
            out["memory_mib"] = own / 2**20 + CONTEXT_OVERHEAD_MIB
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dilu-invoker profile worker")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    ap.add_argument("--formula-scale", type=float, default=1.0)
    args = ap.parse_args(argv)
    worker = Worker(args.device, args.dtype, args.formula_scale)
    out = sys.stdout
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                break
            if op == "info":
                reply: dict[str, Any] = worker.info()
            elif op == "load":
                reply = worker.load(str(req["model"]))
            elif op == "measure":
                reply = worker.measure(req)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply["ok"] = True
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent as a reply
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
