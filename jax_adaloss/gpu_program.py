"""The program XLA:GPU compiles for a function, read on a machine without a GPU.

XLA:GPU compiles ahead of time for a target description (``gpu_targets/``: XLA's H100 SXM
spec, and the same chip with H200's memory and bandwidth); nothing runs. It needs the CUDA
plugin (``pip install 'adaloss[gpu-program]'``: ``jax-cuda12-plugin`` without the CUDA
libraries) and, in the compiling process, ``JAX_PLATFORMS=cpu`` (set by :func:`environment`
before JAX is imported). Without autotuning the GEMMs become Triton GEMM fusions
(``pipeline="triton"``); ``pipeline="cublas"`` turns Triton GEMMs off, as autotuning does
for many shapes on a device.

>>> prog = compile_for(jax.value_and_grad(loss), params, batch, target="h100")  # doctest: +SKIP
>>> prog.converts, prog.fp8_gemms, prog.kernels                                   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from jax_adaloss.weight_grads import compiling_for

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
PIPELINES = ("triton", "cublas")
FP8_TYPES = ("f8e4m3fn", "f8e5m2")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_GEMM_FUSIONS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cudnn$fusion")


def environment() -> None:
    """The process environment a deviceless compile needs (call before importing JAX): the
    CPU as JAX's platform, and the plugin's device checks off."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")


def available() -> bool:
    """Whether the CUDA plugin that compiles for a GPU target is installed."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class GpuProgram:
    """What one compiled GPU program holds (counts over every computation of the optimized
    module; a loop body is counted once).

    Attributes:
      converts: ``{"f8e4m3fn": n, "f8e5m2": n}``, the converts to each fp8 format.
      gemms: GEMMs: cuBLAS custom calls and GEMM fusions.
      gemms_reading_fp8: of those, the ones with an 8-bit operand (a fusion may convert it
        to 16 bits before its dot).
      fp8_gemms: of those, the FP8 GEMMs: ``__cublas$lt$matmul$f8`` calls and GEMM fusions
        whose dot takes two fp8 operands.
      kernels: fusions and custom calls launched (outside fused computations).
      bytes_accessed: XLA's generic cost analysis of the optimized module.
      temp_bytes: the executable's temporary allocation.
      compile_s: seconds to lower and compile.
      text: the optimized HLO.
    """

    converts: dict[str, int]
    gemms: int
    gemms_reading_fp8: int
    fp8_gemms: int
    kernels: int
    bytes_accessed: float
    temp_bytes: int
    compile_s: float
    text: str = dataclasses.field(repr=False)

    def row(self) -> dict[str, Any]:
        """The counts as a JSON-able dict."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "text"}


def _device(target: str) -> Any:
    from jax.experimental import topologies
    if target not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
    spec = resources.files("jax_adaloss").joinpath("gpu_targets", TARGETS[target]).read_text()
    topo = topologies.get_topology_desc(platform="cuda", topology_name="", topology="1x1x1",
                                        target_config=spec)
    return topo.devices[0]


def compile_for(fun: Callable[..., Any], *args: Any, target: str = "h100",
                pipeline: str = "triton") -> GpuProgram:
    """Compile ``jax.jit(fun)`` for ``target`` with ``args``' shapes and dtypes, no device."""
    import jax
    from jax.sharding import SingleDeviceSharding
    if not available():
        raise RuntimeError("compiling for a GPU target needs the CUDA plugin: "
                           "pip install 'adaloss[gpu-program]'")
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    sharding = SingleDeviceSharding(_device(target))
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jax.numpy.shape(a), jax.numpy.result_type(a),
                                                        sharding=sharding), args)
    start = time.perf_counter()
    with compiling_for("cuda"):
        traced = jax.jit(fun).trace(*specs)
    compiled = traced.lower().compile(
        compiler_options={"xla_gpu_enable_triton_gemm": pipeline == "triton"})
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    counts = read_hlo(text)
    return GpuProgram(**counts, bytes_accessed=_bytes_accessed(compiled),
                      temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                      compile_s=seconds, text=text)


def _bytes_accessed(compiled: Any) -> float:
    """XLA's generic cost analysis on the GPU-optimized module (``cost_analysis()`` is not
    implemented for a GPU target; this is what it computes on CPU programs)."""
    import jax
    from jax._src.lib import _jax
    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return float(cost.get("bytes accessed", 0.0))


def jaxpr_casts(fun: Callable[..., Any], *args: Any) -> dict[str, int]:
    """The converts to each fp8 format in ``fun``'s jaxpr (nested jaxprs included, a loop
    body once): the quantizations the compiled program must keep."""
    import jax
    import jax.numpy as jnp
    from jax.extend import core as jcore
    names = {jnp.dtype(jnp.float8_e4m3fn): "f8e4m3fn", jnp.dtype(jnp.float8_e5m2): "f8e5m2"}
    counts = dict.fromkeys(FP8_TYPES, 0)

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "convert_element_type":
                name = names.get(jnp.dtype(eqn.params["new_dtype"]))
                if name is not None:
                    counts[name] += 1
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jax.make_jaxpr(fun)(*args).jaxpr)
    return counts


_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
# "%name = f8e5m2[512,512]{1,0} convert(...)", or with a tuple type "(bf16[..]{..}, s8[..]{0})"
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = (\([^()]*\)|\S+) ([\w\-]+)\((.*)$")


def read_hlo(text: str) -> dict[str, Any]:
    """The counts of :class:`GpuProgram` from an optimized HLO module's text."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    fused: set[str] = set()
    current = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(2), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            name, shape, op, rest = m.groups()
            current.append((name, re.split(r"[\[({]", shape, maxsplit=1)[0] or shape, op, rest))
            if m.group(3) == "fusion":
                called = re.search(r"calls=%([\w.\-]+)", m.group(4))
                if called:
                    fused.add(called.group(1))
    for name in list(fused):  # computations called from fused ones (reducers) are fused too
        for *_, rest in comps.get(name, ()):
            fused.update(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", rest))
    types = {c: {n: d for n, d, _, _ in instrs} for c, instrs in comps.items()}
    converts = dict.fromkeys(FP8_TYPES, 0)
    gemms = reading = fp8 = kernels = 0
    for comp, instrs in comps.items():
        for _, dtype, op, rest in instrs:
            if op == "convert" and dtype in converts:
                converts[dtype] += 1
            if comp in fused or op not in ("fusion", "custom-call"):
                continue
            kernels += 1
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            operand_types = [types[comp].get(o, "") for o in operands]
            if op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', rest)
                if target is None or target.group(1) not in _GEMM_TARGETS:
                    continue
                gemms += 1
                reading += any(t in FP8_TYPES for t in operand_types)
                fp8 += target.group(1).endswith("$f8")
                continue
            kind = re.search(r'"kind":"([^"]+)"', rest)
            if kind is None or kind.group(1) not in _GEMM_FUSIONS:
                continue
            gemms += 1
            reading += any(t in FP8_TYPES for t in operand_types)
            body = re.search(r"calls=%([\w.\-]+)", rest)
            fp8 += body is not None and _dot_takes_fp8(comps, types, body.group(1))
    return {"converts": converts, "gemms": gemms, "gemms_reading_fp8": reading, "fp8_gemms": fp8,
            "kernels": kernels}


def _dot_takes_fp8(comps: dict[str, list[tuple[str, str, str, str]]], types: dict[str, dict[str, str]],
                   comp: str, depth: int = 0) -> bool:
    """Whether a GEMM fusion's dot (possibly in a nested fusion) multiplies two fp8 operands."""
    for _, _, op, rest in comps.get(comp, ()):
        if op == "dot":
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            if len(operands) >= 2 and all(types[comp].get(o, "") in FP8_TYPES for o in operands[:2]):
                return True
        elif op == "fusion" and depth < 4:
            called = re.search(r"calls=%([\w.\-]+)", rest)
            if called and _dot_takes_fp8(comps, types, called.group(1), depth + 1):
                return True
    return False
