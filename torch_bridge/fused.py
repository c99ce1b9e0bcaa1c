"""Compiled scale decisions: each one traced once per signature and compiled into one call.

On an accelerator a decision's scalar math (:mod:`adaloss.solver` on 0-d tensors: the
statistical scale, the caps and bounds, the rounding, the underflow fraction) is some fifty
aten ops, each a kernel launch, against a handful for the statistics it reads; on a CPU the
statistics' passes over the cotangent and the hooks' Python between them cost more than the
math. A :class:`FusedMath` traces a pure function of tensors into an aten graph (``make_fx``
on fake tensors: a branch on a value raises instead of being baked in) and compiles that
graph with inductor: a decision's scalar math alone (:mod:`adaloss.decisions`, 0-d
tensors in and out: one kernel), or its whole work (:mod:`torch_bridge.kernels`: the
statistics of its cotangent and activation, the math, the rescaled cotangent), which inductor
fuses into a few loops over the tensors.

The function's tensors (or ``None``, in any pytree of tuples, lists and NamedTuples) are its
arguments; everything else it reads (the config, a fan-in) is *static*, part of the cache key,
baked into the graph. So are the tensors' shapes and strides: each new shape compiles anew, up
to ``FusedMath(max_shapes=...)`` per decision (a layer, a cast, a merge), beyond which
:meth:`FusedMath.call` warns once and returns ``None`` (the caller then runs the decision op by
op). A size that follows the batch in a 0-d decision is an argument (:meth:`FusedMath.constant`).
Compiled code
computes each operation once in fp32, as JAX and NumPy do (eager torch divides a Python number
by a tensor as a reciprocal times the number, two roundings), and fuses a chain of 16-bit
elementwise ops without rounding between them: the scales, powers of two, are the same as op by
op except where a statistic lands on a rounding boundary; an unrounded statistic may differ in
its last bits.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from torch_bridge._xp import xp

__all__ = ["BACKENDS", "SAY_COMPILE_AFTER", "CompileNotice", "FusedMath", "FusionSchedule"]

#: what :class:`FusedMath` compiles the traced decision with
BACKENDS = ("inductor", "eager")

#: (backend, decision key) -> (compiled graph, the outputs' structure), for the whole process:
#: a scaler made anew (a resumed job, a copy, a second model of the same shapes) reuses what an
#: earlier one compiled; across processes inductor's own FX graph cache (on by default) serves it
_PROCESS_CACHE: dict[Hashable, tuple[Callable[..., Any], Any]] = {}

#: a backward whose compiles took longer than this says so (seconds)
SAY_COMPILE_AFTER = 1.0


class CompileNotice(UserWarning):
    """What ``fuse_decisions`` compiled during a backward and how long it took (the one-time
    stall of the step that compiles); ``warnings.filterwarnings("ignore", category=CompileNotice)``
    silences it."""


class _NoCudaHomeNote(logging.Filter):
    """``torch.utils.cpp_extension`` logs "No CUDA runtime is found" when inductor's C++
    toolchain lookup imports it on a machine with a CUDA toolkit and no GPU: a CPU compile of
    the decisions needs no CUDA, and the :class:`CompileNotice` says what is happening."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No CUDA runtime is found" not in record.getMessage()


@contextlib.contextmanager
def _quiet_toolchain_lookup() -> Iterator[None]:
    if "torch.utils.cpp_extension" in sys.modules:
        yield
        return
    log = logging.getLogger("torch.utils.cpp_extension")
    note = _NoCudaHomeNote()
    log.addFilter(note)
    try:
        yield
    finally:
        log.removeFilter(note)


class FusedMath:
    """Compiled decision functions, cached by function, static arguments and input signature.

    Args:
      backend: ``"inductor"`` (``torch._inductor.compile``: the backward's hooks run with
        dynamo disabled, so not through ``torch.compile``) or ``"eager"`` (the traced graph run
        op by op: the same ops as the function's own).
      max_shapes: how many shapes of its tensors one decision compiles for, over steps (as
        ``torch._dynamo.config.recompile_limit``); beyond them :meth:`call` returns ``None``.
      steady_after: backwards in a row whose decisions meet the same shapes before the scaler
        runs them compiled (0: from the first backward).
    """

    def __init__(self, backend: str = "inductor", max_shapes: int = 8, steady_after: int = 0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name, value, least in (("max_shapes", max_shapes, 1), ("steady_after", steady_after, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self.backend, self.max_shapes, self.steady_after = backend, max_shapes, steady_after
        #: why the backend could not compile here (then nothing compiles), or None
        self.failed: str | None = None
        # key -> (compiled graph, the outputs' structure)
        self._compiled: dict[Hashable, tuple[Callable[..., Any], Any]] = {}
        self._shapes: dict[Hashable, set[Hashable]] = {}  # (decision, signature) -> its shapes
        self._warned = False
        self._constants: dict[tuple[Any, ...], torch.Tensor] = {}
        #: graphs compiled (not found in the process's cache) and the seconds that took, since
        #: :meth:`say_compiles` last ran (the backward in progress)
        self.compiles, self.compile_s = 0, 0.0

    def constant(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``value`` as a 0-d tensor on ``device``, made once (a size that follows the batch is
        an argument of the compiled decision, not baked into it; on an accelerator, a fresh
        tensor from a Python number would be a copy from the host each time)."""
        key = (value, dtype, device)
        got = self._constants.get(key)
        if got is None:
            got = self._constants[key] = torch.tensor(value, dtype=dtype, device=device)
        return got

    def __len__(self) -> int:
        """How many graphs were compiled."""
        return len(self._compiled)

    def __call__(self, fn: Callable[..., Any], static: tuple[Hashable, ...], *args: Any) -> Any:
        """``fn(*static, xp, *args)`` (``xp``: :data:`torch_bridge._xp.xp`) on 0-d tensors,
        compiled: a decision's scalar math, whose signature has one shape."""
        return self._run(fn, static, args, scalars=True)

    def call(self, fn: Callable[..., Any], static: tuple[Hashable, ...], *args: Any,
             point: Hashable = None) -> Any:
        """``fn(*static, xp, *args)`` on tensors of any shape, compiled for their shapes and
        strides; ``None`` where the decision ``point`` (a layer's name: shapes are counted per
        decision, over steps) compiled ``max_shapes`` of them already (warned once)."""
        return self._run(fn, static, args, scalars=False, point=point)

    def _run(self, fn: Callable[..., Any], static: tuple[Hashable, ...], args: tuple[Any, ...],
             scalars: bool, point: Hashable = None) -> Any:
        tensors: list[torch.Tensor] = []
        spec = _flatten(args, tensors, fn, scalars)
        site = (fn, static, spec, tuple((t.dtype, t.device) for t in tensors))
        key = site if scalars else (site, tuple((t.shape, t.stride()) for t in tensors))
        # (the backward's saved activations require grad: the graph is compiled for inference)
        tensors = [t.detach() if t.requires_grad else t for t in tensors]
        hit = self._compiled.get(key)
        if hit is None and self.failed is None:
            if not scalars:
                shapes = self._shapes.setdefault((point, site), set())
                if key not in shapes and len(shapes) >= self.max_shapes:
                    self._warn(fn, point)
                    return None
                shapes.add(key)
            hit = _PROCESS_CACHE.get((self.backend, key))
            if hit is None:
                t0 = time.perf_counter()
                hit = self._compile(fn, static, spec, tensors)
                self.compiles += 1
                self.compile_s += time.perf_counter() - t0
                if hit is not None:
                    _PROCESS_CACHE[(self.backend, key)] = hit
            if hit is not None:
                self._compiled[key] = hit
        if hit is None:  # the backend cannot compile here: op by op (a scalar decision: right here)
            return fn(*static, xp, *args) if scalars else None
        compiled, out_spec = hit
        return _unflatten(out_spec, iter(compiled(*tensors)))

    def say_compiles(self, stacklevel: int = 2) -> None:
        """At the end of a backward: a :class:`CompileNotice` if its compiles took longer than
        :data:`SAY_COMPILE_AFTER` (what compiled, for how long, and what avoids it)."""
        n, took = self.compiles, self.compile_s
        self.compiles, self.compile_s = 0, 0.0
        if n == 0 or took < SAY_COMPILE_AFTER or self.failed is not None:
            return
        warnings.warn(
            f"fuse_decisions: this backward compiled {n} of its scale decisions with {self.backend} "
            f"in {took:.1f} s, a one-time cost per shape of their tensors (the decisions' work as a "
            "few fused calls per layer: faster steps from now on). This process reuses them; another "
            "process finds them in torch's inductor cache and compiles faster. fuse_decisions=False "
            "never compiles (the decisions then run op by op).", CompileNotice, stacklevel=stacklevel + 1)

    def _warn(self, fn: Callable[..., Any], point: Hashable) -> None:
        """Once per :class:`FusedMath`: the first decision past :attr:`max_shapes`."""
        if self._warned:
            return
        self._warned = True
        at = "" if point is None else f" (at {point})"
        warnings.warn(
            f"fuse_decisions: {fn.__module__}.{fn.__name__}{at} was compiled for {self.max_shapes} "
            "shapes of its tensors already; tensors of other shapes take the op-by-op path from now "
            "on, at this decision and any other past its limit (slower, the same decisions). Pad "
            "batches to a few fixed shapes, raise FusedMath(max_shapes=...), or use "
            "fuse_decisions=False where shapes vary every step.", RuntimeWarning, stacklevel=3)

    def _compile(self, fn: Callable[..., Any], static: tuple[Hashable, ...], spec: Any,
                 tensors: list[torch.Tensor]) -> tuple[Callable[..., Any], Any] | None:
        """The traced graph, compiled, and its outputs' structure; ``None`` (warned once, and
        ``failed`` set) where the backend raises: it cannot compile on this machine. A
        function that cannot be traced raises (a bug in it, not in the machine)."""
        from torch.fx.experimental.proxy_tensor import make_fx

        out_spec: list[Any] = []

        def flat(*ts: torch.Tensor) -> list[torch.Tensor]:
            out: list[torch.Tensor] = []
            out_spec.append(_flatten(fn(*static, xp, *_unflatten(spec, iter(ts))), out, fn, False, "returns"))
            return out

        # one fresh tensor per argument: make_fx traces a tensor passed twice (two parts carrying
        # one scale object) as one input, and a later call may pass two
        tensors = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in tensors]
        with torch.no_grad():
            graph = make_fx(flat, tracing_mode="fake")(*tensors)
            if self.backend == "eager":
                return graph, out_spec[0]
            from torch import _inductor  # not through dynamo: the hooks run with it disabled

            try:
                with _quiet_toolchain_lookup():
                    return _inductor.compile(graph, tensors), out_spec[0]
            except Exception as e:  # noqa: BLE001 (a missing compiler, an unsupported device, ...)
                said = str(e).strip()
                self.failed = f"{type(e).__name__}: {said.splitlines()[0] if said else ''}"
                warnings.warn(
                    f"fuse_decisions: {self.backend} could not compile a decision on "
                    f"{tensors[0].device.type if tensors else 'this machine'} ({self.failed}); every "
                    "decision runs op by op from now on (the same decisions, slower). Install what the "
                    "backend needs (inductor on a CPU: a C++ compiler), or pass fuse_decisions=False "
                    "to skip compiling.", RuntimeWarning, stacklevel=4)
                return None


_TENSOR = "tensor"  # a leaf of a spec


def _flatten(v: Any, leaves: list[torch.Tensor], fn: Callable[..., Any], scalars: bool,
             role: str = "takes") -> Any:
    """The tensors of ``v`` (tensors and ``None`` in tuples, lists and NamedTuples) appended to
    ``leaves``, and its structure (hashable: what :func:`_unflatten` rebuilds ``v`` from); what
    ``fn`` ``role`` (takes, returns) must be tensors (``scalars``: 0-d)."""
    if isinstance(v, torch.Tensor):
        if scalars and v.dim() != 0:
            raise TypeError(f"{fn.__name__}: a fused decision {role} 0-d tensors, got Tensor{list(v.shape)}")
        leaves.append(v)
        return _TENSOR
    if v is None:
        return None
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_flatten(x, leaves, fn, scalars, role) for x in v)
    raise TypeError(f"{fn.__name__}: a fused decision {role} {'0-d tensors' if scalars else 'tensors'}, "
                    f"got {type(v).__name__}")


def _unflatten(spec: Any, leaves: Any) -> Any:
    """What :func:`_flatten` took apart, from its structure and an iterator of tensors."""
    if spec is _TENSOR:
        return next(leaves)
    if spec is None:
        return None
    cls, children = spec
    items = [_unflatten(c, leaves) for c in children]
    return cls(*items) if hasattr(cls, "_fields") else cls(items)


class FusionSchedule:
    """When a scaler's backwards run their decisions compiled: with ``fused`` (``None``: never),
    once the last ``fused.steady_after`` backwards met their decisions with the same shapes
    (``BackwardRecord.shapes``), until the shapes change or the backend
    fails (:attr:`FusedMath.failed`). Pickled with ``fused``'s settings, not its compiled calls."""

    def __init__(self, fused: FusedMath | None) -> None:
        self.fused = fused
        self.shapes: tuple[Any, ...] | None = None  # the decisions' shapes in the last backward
        self.steady = 0  # backwards in a row that met them
        self.active = False  # the backward in progress runs its decisions compiled

    def next(self) -> FusedMath | None:
        """The compiled decisions for the backward being prepared, or ``None``: op by op."""
        f = self.fused
        self.active = f is not None and f.failed is None and self.steady >= f.steady_after
        return f if self.active else None

    def saw(self, shapes: tuple[Any, ...], stacklevel: int = 2) -> None:
        """A backward finished whose decisions met ``shapes`` (and said what it compiled;
        ``stacklevel``: the caller's frame to point at, as ``warnings.warn``'s)."""
        if self.active and self.fused is not None:
            self.fused.say_compiles(stacklevel + 1)
        if shapes == self.shapes:
            self.steady += 1
        else:
            self.shapes, self.steady = shapes, 1

    def __getstate__(self) -> dict[str, Any]:
        f = self.fused
        return {**self.__dict__, "fused": None if f is None else (f.backend, f.max_shapes, f.steady_after)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        fused = state.pop("fused")
        self.__dict__.update(state)
        self.fused = None if fused is None else FusedMath(*fused)
