"""Pipeline stages of a split instance, on the action's side (docs/runtime.md, "Pipeline stages").

A split instance is one instance of an action served as N ≥ 2 stages, each its own runtime process on its
own GPU. The invoker starts stage k of N with ``DILU_STAGE_INDEX`` (k), ``DILU_STAGE_COUNT`` (N) and
``DILU_STAGE_SPAN`` ("a:b", the [a, b) share of the model the stage holds) in the /init environment. A run
is a pipeline: the activation's params are stage 0's ``args``, each stage's result the next one's ``args``,
the last stage's result the activation's.

    from dilu_invoker.actions import pipeline

    me = pipeline.stage()                       # Stage(0, 1, (0.0, 1.0)) in an ordinary instance
    mine = me.layers(24)                        # this stage's layers of a 24-layer model

    def main(args):
        x, meta = pipeline.receive(args) if not me.first else (embed(args), {"n": args["n"]})
        for i in mine:
            x = block[i](x)
        return pipeline.send(x, **meta) if not me.last else {"text": decode(x)}

numpy and torch are optional: the module imports without either, ``send`` takes whichever the tensor is,
``receive`` gives torch when torch is installed (on this process's CUDA device when there is one) and numpy
otherwise.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dilu_invoker.actions._ipc import STAGE_FIELD, Blob

ENV_INDEX = "DILU_STAGE_INDEX"
ENV_COUNT = "DILU_STAGE_COUNT"
ENV_SPAN = "DILU_STAGE_SPAN"
#: the field of an intermediate result that carries the tensor
FIELD = STAGE_FIELD
#: dtype name on the wire -> (item size, numpy name). bfloat16 has no numpy type: without torch it is read as
#: its raw 16 bits (uint16), as the models API does.
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "float64"), "float32": (4, "float32"), "float16": (2, "float16"), "bfloat16": (2, "uint16"),
    "int64": (8, "int64"), "int32": (4, "int32"), "int16": (2, "int16"), "int8": (1, "int8"),
    "uint8": (1, "uint8"), "bool": (1, "bool"),
}


@dataclass(frozen=True, slots=True)
class Stage:
    """Stage `index` of `count`, holding the [a, b) share `span` of the model (by memory)."""

    index: int
    count: int
    span: tuple[float, float]

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a pipeline has at least one stage, not {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"stage index {self.index} is not in 0..{self.count - 1}")
        a, b = self.span
        if not (math.isfinite(a) and math.isfinite(b) and 0.0 <= a <= b <= 1.0):
            raise ValueError(f"span {a}:{b} is not a [a, b) part of [0, 1]")
        if self.first and a != 0.0:
            raise ValueError(f"the first stage's span starts at 0, not {a}")
        if self.last and b != 1.0:
            raise ValueError(f"the last stage's span ends at 1, not {b}")

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, n: int) -> range:
        """This stage's layers of a model of `n` layers.

        Boundary i (the start of stage i) at span value s lies at layer ``i + round(s * (n - count))`` when
        n ≥ count: every stage holds one layer plus its share of the other n − count, so the stages' ranges
        tile 0..n with no gap or overlap and none is empty, whatever the spans, and each stage computes its
        own range from its own span alone (the invoker gives neighbours the same boundary). That is
        ``round(s * n)`` for an even split and within one layer of it for two stages. With fewer layers than
        stages the boundary is ``round(s * n)``: the ranges still tile 0..n, some are empty.
        """
        if n < 0:
            raise ValueError(f"a model has a non-negative number of layers, not {n}")
        return range(self._boundary(self.index, self.span[0], n), self._boundary(self.index + 1, self.span[1], n))

    def _boundary(self, i: int, s: float, n: int) -> int:
        if i == 0:
            return 0
        if i == self.count:
            return n
        if n >= self.count:
            return i + _round_half_up(s * (n - self.count))
        return _round_half_up(s * n)


def _round_half_up(x: float) -> int:
    # Not round(): banker's rounding would turn 16.5 into 16 but 17.5 into 18.
    return math.floor(x + 0.5)


def _parse_int(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def _parse_span(text: str) -> tuple[float, float]:
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"{ENV_SPAN}={text!r} is not two numbers 'a:b'")
    try:
        a, b = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"{ENV_SPAN}={text!r} is not two numbers 'a:b'") from None
    return a, b


def stage(environ: Mapping[str, str] | None = None) -> Stage:
    """This process's stage, from the environment (`os.environ` unless given); ``Stage(0, 1, (0.0, 1.0))``
    outside a split instance. Any variable missing or malformed while another is set is a ValueError naming it."""
    env = os.environ if environ is None else environ
    names = (ENV_INDEX, ENV_COUNT, ENV_SPAN)
    if not any(name in env for name in names):
        return Stage(0, 1, (0.0, 1.0))
    for name in names:
        if name not in env:
            raise ValueError(f"{name} is not set, but {', '.join(n for n in names if n in env)} is: "
                             f"a split instance's stage needs all three")
    index = _parse_int(ENV_INDEX, env[ENV_INDEX])
    count = _parse_int(ENV_COUNT, env[ENV_COUNT])
    span = _parse_span(env[ENV_SPAN])
    if count < 1:
        raise ValueError(f"{ENV_COUNT}={env[ENV_COUNT]!r}: a pipeline has at least one stage")
    if not 0 <= index < count:
        raise ValueError(f"{ENV_INDEX}={env[ENV_INDEX]!r} is not in 0..{count - 1} ({ENV_COUNT}={count})")
    try:
        return Stage(index, count, span)
    except ValueError as exc:
        raise ValueError(f"{ENV_SPAN}={env[ENV_SPAN]!r}: {exc}") from None


# -- the intermediate result -----------------------------------------------------------------------------


def _torch() -> Any | None:
    """torch if the process has imported it (a tensor from torch means it has): send never imports it."""
    return sys.modules.get("torch")


def _import_torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def send(x: Any, **meta: Any) -> dict[str, Any]:
    """The intermediate result carrying tensor `x` to the next stage, with `meta` (small JSON values it needs).

    `x` is a torch tensor (any device; copied to the CPU, dtype kept, bfloat16 included) or a numpy array."""
    if FIELD in meta:
        raise ValueError(f"{FIELD!r} is the tensor's field; give the meta another name")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the meta must be JSON values: {exc}") from None
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"cannot send a tensor of dtype {x.dtype}")
        flat = x.detach().to("cpu").contiguous().reshape(-1)
        # A byte view, not .numpy(): numpy has no bfloat16.
        data: Any = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""
        shape = list(x.shape)
    else:
        np = sys.modules.get("numpy")
        if np is None or not isinstance(x, np.ndarray | np.generic):
            raise TypeError(f"send takes a torch tensor or a numpy array, not {type(x).__name__}")
        x = np.asarray(x)
        dtype = x.dtype.name
        if dtype not in DTYPES or DTYPES[dtype][1] != dtype:
            raise ValueError(f"cannot send an array of dtype {x.dtype}")
        data = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).reshape(-1).view(np.uint8).data
        shape = list(x.shape)
    # The bytes as they are: the runtime writes them as base64 wherever the result is JSON, and as they are in a
    # stage frame on the direct lane (no base64, no JSON of them; docs/runtime.md, "Pipeline stages").
    # (`data` a view of the tensor's bytes: the Blob is their one copy)
    wire = {"dtype": dtype, "shape": shape, "data": Blob(data)}
    return {FIELD: wire, **meta}


def _check(args: Any) -> tuple[str, list[int], bytes | bytearray | memoryview]:
    if not isinstance(args, Mapping) or FIELD not in args:
        raise ValueError(f"not an intermediate result: no {FIELD!r} field (was the previous stage's result made by send?)")
    wire = args[FIELD]
    if not isinstance(wire, Mapping):
        raise ValueError(f"{FIELD!r} is not an object")
    dtype, shape, data = wire.get("dtype"), wire.get("shape"), wire.get("data")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{FIELD}.dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{FIELD}.shape {shape!r} is not a list of non-negative integers")
    if isinstance(data, bytes | bytearray | memoryview):  # a stage frame's blob (or `send`'s own result)
        raw = data.cast("B") if isinstance(data, memoryview) else data
    elif not isinstance(data, str):
        raise ValueError(f"{FIELD}.data is not a base64 string")
    else:
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{FIELD}.data is not valid base64: {exc}") from None
    expected = math.prod(shape) * DTYPES[dtype][0]
    if len(raw) != expected:
        raise ValueError(f"{FIELD}.data holds {len(raw)} bytes, but {dtype} of shape {shape} is {expected}")
    return dtype, shape, raw


def receive(args: Any, *, device: str | None = None, as_numpy: bool = False) -> tuple[Any, dict[str, Any]]:
    """The tensor and the meta of the previous stage's `send`.

    The tensor is torch when torch is installed — on `device`, by default this process's CUDA device when
    there is one, else the CPU — and numpy otherwise or with `as_numpy` (bfloat16 then as uint16 bits)."""
    dtype, shape, raw = _check(args)
    meta = {k: v for k, v in args.items() if k != FIELD}
    torch = None if as_numpy else _import_torch()
    if torch is not None:
        tdtype = getattr(torch, dtype)
        if raw:
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdtype).reshape(shape)
        else:
            t = torch.empty(shape, dtype=tdtype)
        if device is None and torch.cuda.is_available():
            device = f"cuda:{torch.cuda.current_device()}"
        return (t if device is None else t.to(device)), meta
    try:
        import numpy as np
    except ImportError:
        raise RuntimeError("receive needs numpy or torch, and neither is installed") from None
    if device not in (None, "cpu"):
        raise ValueError(f"a numpy array lives on the CPU, not on {device}")
    return np.frombuffer(raw, dtype=np.dtype(DTYPES[dtype][1]).newbyteorder("<")).reshape(shape).copy(), meta
