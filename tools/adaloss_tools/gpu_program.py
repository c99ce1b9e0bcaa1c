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
import math
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
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


def _array_bytes(shape: str, workspace: bool = False) -> int:
    """Bytes of an HLO shape (a tuple's arrays summed; ``workspace``: a cuBLAS call's result,
    whose last array is its scratch space, left out)."""
    arrays = _ARRAY.findall(shape)
    if workspace:
        arrays = arrays[:-1]
    return sum(_ITEMSIZE.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in arrays)


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
      kernel_bytes: the bytes those kernels move if each reads its operands and writes its
        results once (cuBLAS workspaces left out): the memory traffic of the program as
        launched.
      kernels_run: the kernels one run of the program launches: a loop's body counted once
        per iteration (its known trip count).
      kernel_bytes_run: the bytes those move.
      second_passes: ``{"f8e4m3fn": n, "f8e5m2": n}``, the kernels casting a tensor to that
        format whose scale needed another kernel to read the tensor first, other than
        through a GEMM (per-tensor current scaling where the reduction cannot join the kernel
        that writes the tensor).
      bytes_accessed: XLA's generic cost analysis of the optimized module (it counts a fused
        operand once per use inside the fusion, and no kernel boundaries).
      flops: the same analysis's floating-point operations (a loop body once).
      temp_bytes: the executable's temporary allocation.
      compile_s: seconds to lower and compile.
      text: the optimized HLO.
    """

    converts: dict[str, int]
    gemms: int
    gemms_reading_fp8: int
    fp8_gemms: int
    kernels: int
    kernel_bytes: int
    kernels_run: int
    kernel_bytes_run: int
    second_passes: dict[str, int]
    bytes_accessed: float
    flops: float
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
    spec = resources.files("adaloss_tools").joinpath("gpu_targets", TARGETS[target]).read_text()
    topo = topologies.get_topology_desc(platform="cuda", topology_name="", topology="1x1x1",
                                        target_config=spec)
    return topo.devices[0]


def compile_for(fun: Callable[..., Any], *args: Any, target: str = "h100",
                pipeline: str = "triton", donate_argnums: tuple[int, ...] = ()) -> GpuProgram:
    """Compile ``jax.jit(fun)`` for ``target`` with ``args``' shapes and dtypes, no device;
    ``donate_argnums`` as ``jax.jit``'s (a training step's state, donated as training loops do:
    an output that is an unchanged input then costs no copy)."""
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
    with compiling_for("cuda"):  # a fresh function: JAX's trace cache must not hand back (or
        # keep) a trace made for the CPU, whose bf16 dots adaloss widens
        traced = jax.jit(lambda *a: fun(*a), donate_argnums=donate_argnums).trace(*specs)
    compiled = traced.lower().compile(
        compiler_options={"xla_gpu_enable_triton_gemm": pipeline == "triton"})
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    counts = read_hlo(text)
    bytes_accessed, flops = _cost(compiled)
    return GpuProgram(**counts, bytes_accessed=bytes_accessed, flops=flops,
                      temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                      compile_s=seconds, text=text)


def _cost(compiled: Any) -> tuple[float, float]:
    """Bytes accessed and flops from XLA's generic cost analysis of the GPU-optimized module
    (``cost_analysis()`` is not implemented for a GPU target; this is what it computes on CPU
    programs)."""
    import jax
    from jax._src.lib import _jax
    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0))


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
_NAMED = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*)$")
#: instructions outside fusions that launch nothing: buffers, views, tuples and control flow
#: (the computations a loop or call runs are counted where they launch)
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
                   "conditional", "after-all", "add-dependency", "opt-barrier", "partition-id",
                   "replica-id", "domain"})


def _instruction(line: str) -> tuple[str, str, str, str] | None:
    """``(name, shape, opcode, text after "opcode(")`` of one instruction line, or ``None``.

    The shape is an array type (``f8e5m2[512,512]{1,0}``) or a tuple of them, nested to any
    depth (``((f32[48]{0}, f32[48]{0}), f16[768,64]{1,0})``: a fusion computing statistics beside
    a convert)."""
    m = _NAMED.match(line)
    if m is None:
        return None
    name, rest = m.groups()
    if rest.startswith("("):
        depth = 0
        end = None
        for i, c in enumerate(rest):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                end = i + 1
                break
        if end is None:
            return None
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op, paren, rest = rest.partition("(")
    if not paren or not re.fullmatch(r"[\w\-]+", op):
        return None
    return name, shape, op, rest


_Computations = dict[str, list[tuple[str, str, str, str]]]


def _parse(text: str) -> tuple[_Computations, set[str], dict[str, str], str | None]:
    """An optimized module's computations (each a list of ``(name, dtype, opcode, rest)``), the
    fused ones (a fusion's body, a reducer or comparator, and what those call: none launches a
    kernel of its own), every instruction's shape, and the entry.

    Raises ``ValueError`` on an instruction line it cannot read: a count that skips what it
    cannot parse reports fewer kernels than the program launches."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    fused: set[str] = set()
    shapes: dict[str, str] = {}  # instruction names are unique in a module
    current = None
    entry = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(2), [])
            entry = m.group(2) if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None or not _NAMED.match(line):
            continue
        parsed = _instruction(line)
        if parsed is None:
            raise ValueError(f"gpu_program cannot read this HLO instruction: {line.strip()[:200]}")
        name, shape, op, rest = parsed
        current.append((name, re.split(r"[\[({]", shape, maxsplit=1)[0] or shape, op, rest))
        shapes[name] = shape
        if op != "call":  # a fusion's body, a reducer, a comparator: run inside one kernel
            fused.update(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", rest))
    stack = list(fused)
    while stack:  # computations called from those run inside the same kernel
        for *_, rest in comps.get(stack.pop(), ()):
            for called in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", rest):
                if called not in fused:
                    fused.add(called)
                    stack.append(called)
    return comps, fused, shapes, entry


def read_hlo(text: str) -> dict[str, Any]:
    """The counts of :class:`GpuProgram` from an optimized HLO module's text.

    A kernel is every instruction of an unfused computation that is not free (:data:`_FREE`):
    fusions, custom calls, and bare ``copy`` (XLA copies a value that leaves the program twice,
    or a parameter or constant that leaves it), ``sort``, collectives and whatever else the
    compiler leaves unfused."""
    comps, fused, shapes, entry = _parse(text)
    types = {c: {n: d for n, d, _, _ in instrs} for c, instrs in comps.items()}
    converts = dict.fromkeys(FP8_TYPES, 0)
    gemms = reading = fp8 = kernels = kernel_bytes = 0
    own: dict[str, list[int]] = {}  # computation -> [kernels, bytes] launched by its own instructions
    for comp, instrs in comps.items():
        for name, dtype, op, rest in instrs:
            if op == "convert" and dtype in converts:
                converts[dtype] += 1
            if comp in fused or op in _FREE:
                continue
            kernels += 1
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            operand_types = [types[comp].get(o, "") for o in operands]
            gemm = _is_gemm(op, rest)
            called = re.search(r"calls=%([\w.\-]+)", rest) if op == "fusion" else None
            moved = _moved(comps, shapes, operands, name, called.group(1) if called else None,
                           workspace=gemm and op == "custom-call")
            kernel_bytes += moved
            counts = own.setdefault(comp, [0, 0])
            counts[0] += 1
            counts[1] += moved
            if not gemm:
                continue
            gemms += 1
            reading += any(t in FP8_TYPES for t in operand_types)
            if op == "custom-call":
                fp8 += re.search(r'custom_call_target="([^"]+)"', rest).group(1).endswith("$f8")
                continue
            body = re.search(r"calls=%([\w.\-]+)", rest)
            fp8 += body is not None and _dot_takes_fp8(comps, types, body.group(1))
    run = _launched(comps, own, entry) if entry is not None else (kernels, kernel_bytes)
    return {"converts": converts, "gemms": gemms, "gemms_reading_fp8": reading, "fp8_gemms": fp8,
            "kernels": kernels, "kernel_bytes": kernel_bytes, "kernels_run": run[0],
            "kernel_bytes_run": run[1], "second_passes": _second_passes(comps, fused, shapes)}


def _moved(comps: dict[str, list[tuple[str, str, str, str]]], shapes: dict[str, str], operands: list[str],
           name: str, fused: str | None, workspace: bool) -> int:
    """The bytes a kernel reads and writes: each operand and result once, but an operand a
    fusion reads only through ``dynamic-slice`` counts the slices, and one it updates in place
    (``dynamic-update-slice``, the loop buffers of a scan) the update written, not the buffer."""
    whole = [_array_bytes(shapes.get(o, "")) for o in operands]
    out = _array_bytes(shapes[name], workspace=workspace)
    if fused is None:
        return sum(whole) + out
    instrs = comps.get(fused, [])
    params: dict[str, int] = {}
    source: dict[str, str] = {}  # an instruction -> what it bitcasts, transitively
    for n, _, op, rest in instrs:
        args = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        if op == "parameter":
            params[n] = int(re.match(r"(\d+)", rest).group(1))
        elif op == "bitcast" and args:
            source[n] = source.get(args[0], args[0])
    sliced: dict[int, int] = {}  # parameter index -> bytes read through dynamic slices
    other: set[int] = set()  # parameters read whole
    in_place: dict[str, int] = {}  # a dynamic-update-slice -> the bytes it writes
    for n, _, op, rest in instrs:
        args = [source.get(a, a) for a in re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])]
        if op in ("parameter", "bitcast"):
            continue
        for k, a in enumerate(args):
            if a not in params:
                continue
            i = params[a]
            if op == "dynamic-slice" and k == 0:
                sliced[i] = sliced.get(i, 0) + _array_bytes(shapes.get(n, ""))
            elif op == "dynamic-update-slice" and k == 0:
                in_place[n] = _array_bytes(shapes.get(args[1], "")) if len(args) > 1 else 0
            else:
                other.add(i)
    read = sum(b if i in other or (i not in sliced and not _updated(i, params, instrs, source)) else
               sliced.get(i, 0) for i, b in enumerate(whole))
    root = next((x for x in instrs if x[0] in in_place), None) if in_place else None
    if root is None:
        return read + out
    # results written in place: the updates, for the rest of the result the arrays as they are
    written = out - sum(_array_bytes(shapes.get(n, "")) for n in in_place) + sum(in_place.values())
    return read + max(written, 0)


def _updated(i: int, params: dict[str, int], instrs: list[tuple[str, str, str, str]],
             source: dict[str, str]) -> bool:
    """Whether fusion parameter ``i`` is the buffer of a dynamic-update-slice (updated in place)."""
    names = {n for n, j in params.items() if j == i}
    for _, _, op, rest in instrs:
        args = [source.get(a, a) for a in re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])]
        if op == "dynamic-update-slice" and args and args[0] in names:
            return True
    return False


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _launched(comps: dict[str, list[tuple[str, str, str, str]]], own: dict[str, list[int]], entry: str
              ) -> tuple[int, int]:
    """Kernels and bytes one run of ``entry`` launches: a ``while`` loop's body (and condition)
    times its known trip count (once where XLA knows none), a called computation once."""
    def walk(comp: str, depth: int = 0) -> tuple[int, int]:
        k, b = own.get(comp, [0, 0])
        for _, _, op, rest in comps.get(comp, ()):
            if depth > 16 or op not in ("while", "call", "conditional"):
                continue
            trips = 1
            if op == "while":
                m = _TRIP_COUNT.search(rest)
                trips = int(m.group(1)) if m else 1
            for key in ("body", "condition", "to_apply", "branch_computations", "true_computation",
                        "false_computation"):
                for called in re.findall(key + r"=\{?%([\w.\-]+)", rest):
                    n = trips + 1 if key == "condition" else trips
                    ck, cb = walk(called, depth + 1)
                    k, b = k + n * ck, b + n * cb
        return k, b
    return walk(entry)


_WIDE = ("f16", "bf16", "f32")


def _is_gemm(op: str, rest: str) -> bool:
    """Whether a kernel is a GEMM: a cuBLAS(Lt) call or a GEMM fusion."""
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        return target is not None and target.group(1) in _GEMM_TARGETS
    kind = re.search(r'"kind":"([^"]+)"', rest) if op == "fusion" else None
    return kind is not None and kind.group(1) in _GEMM_FUSIONS


def _elements(shape: str) -> list[int]:
    """The element counts of an HLO shape's arrays."""
    return [math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(shape)]


def _second_passes(comps: dict[str, list[tuple[str, str, str, str]]], fused: set[str],
                   shapes: dict[str, str]) -> dict[str, int]:
    """Per fp8 format, the kernels that cast a wide tensor to it after another kernel read the
    same tensor only to reduce it (every result a quarter of its size or less), for the cast
    (the cast depends on it, not through a GEMM, whose input is another tensor): the reduction
    of per-tensor current scaling as a second pass over its tensor. A reduction fused into the
    kernel that writes the tensor is no second pass."""
    def converts_in(comp: str, depth: int = 0) -> set[str]:
        out = set()
        for _, dtype, op, rest in comps.get(comp, ()):
            if op == "convert" and dtype in FP8_TYPES:
                out.add(dtype)
            elif op == "fusion" and depth < 4:
                called = re.search(r"calls=%([\w.\-]+)", rest)
                out |= converts_in(called.group(1), depth + 1) if called else set()
        return out

    counts = dict.fromkeys(FP8_TYPES, 0)
    for comp, instrs in comps.items():
        if comp in fused:
            continue
        ops = {name: (op, re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0]), rest)
               for name, _, op, rest in instrs}

        def buffer(name: str, ops: dict[str, Any] = ops) -> Any:
            """The buffer an operand names: through bitcasts and tuple elements."""
            op, operands, rest = ops.get(name, ("", [], ""))
            if op == "bitcast" and operands:
                return buffer(operands[0], ops)
            if op == "get-tuple-element" and operands:
                return (buffer(operands[0], ops), re.search(r"index=(\d+)", rest).group(1))
            return name

        wide = {}  # kernel -> {buffer: elements} of its wide array operands
        for name, (op, operands, _) in ops.items():
            if op in ("fusion", "custom-call"):
                wide[name] = {buffer(o): _elements(shapes[o])[0] for o in operands
                              if shapes.get(o, "").split("[")[0] in _WIDE and "[" in shapes[o]}
        reductions = {name: {b for b, n in reads.items() if max(_elements(shapes[name]), default=0) * 4 <= n}
                      for name, reads in wide.items()}  # buffers a kernel only reduces
        for name, (op, operands, rest) in ops.items():
            called = re.search(r"calls=%([\w.\-]+)", rest) if op == "fusion" else None
            formats = converts_in(called.group(1)) if called else set()
            if not formats or not wide[name]:
                continue
            seen, stack = {name}, list(operands)
            while stack:  # the instructions the cast depends on
                a = stack.pop()
                if a in seen:
                    continue
                seen.add(a)
                if reductions.get(a, set()) & wide[name].keys():
                    for f in formats:
                        counts[f] += 1
                    break
                if not _is_gemm(*ops.get(a, ("", [], ""))[::2]):  # a GEMM's input is no
                    stack.extend(ops.get(a, ("", [], ""))[1])    # statistic of the cast's tensor
    return counts


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


#: what each kernel of an adaloss program does, from the functions on the stack of the value it
#: writes (the optimized HLO keeps the frames JAX traced it under), checked in this order
CATEGORIES = ("scalars", "merges", "statistics", "rescales", "model")
_MERGE_FRAMES = frozenset(("_Sweep.merge", "one_scale", "_Sweep._agree", "agree_across"))
#: what a merge does beyond the sum the model has too (parts that share a scale add as they are)
_MERGE_WORK = frozenset(("rescale", "_stored", "_absmaxes", "statistics_of"))
_STAT_FRAMES = frozenset(("statistics", "statistics_of", "_absmax", "_absmaxes", "log_magnitudes",
                          "magnitude_stats", "fit_current"))
_RESCALE_FRAMES = frozenset(("rescale", "_rescale"))
_MODEL_FRAMES = frozenset(("_Sweep._transpose", "input_grad"))  # a rescale inside the vjp
_PASS_THROUGH = ("tuple", "bitcast", "get-tuple-element")
#: a kernel whose every result is at most this many bytes, reading at most :data:`_SCALAR_READ`:
#: a decision's scalar math, or a copy of a scalar output
_SCALAR_OUT, _SCALAR_READ = 64, 4096


def _frames(text: str) -> dict[int, list[str]]:
    """stack frame id -> the function names on it, innermost first (the module's StackFrames)."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line) if current is not None else None
        if m is None:
            current = None if line.strip() == "" or not line[:1].isdigit() else current
            continue
        current[int(m.group(1))] = m.group(2)
    names = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    loc_fn = {k: int(re.search(r"function_name_id=(\d+)", v).group(1))
              for k, v in sections.get("FileLocations", {}).items()}
    frames = {k: (int(re.search(r"file_location_id=(\d+)", v).group(1)),
                  int(re.search(r"parent_frame_id=(\d+)", v).group(1)))
              for k, v in sections.get("StackFrames", {}).items()}
    out: dict[int, list[str]] = {}
    for k in frames:  # a frame's parent is printed one above its id (0: none)
        stack, f = [], k
        while f in frames and len(stack) < 256:
            loc, parent = frames[f]
            stack.append(names.get(loc_fn.get(loc, 0), ""))
            f = parent - 1
        out[k] = stack
    return out


def attribute(text: str, kernels: list[tuple[str, str, int]] | None = None) -> dict[str, dict[str, int]]:
    """Kernels launched per run and the bytes they move, per category of :data:`CATEGORIES`:
    ``scalars`` (every result a few bytes: decisions, copies of scalar outputs), ``merges``
    (contributions brought to one scale and summed: their max passes, rescales, stored sums; a
    sum of parts that share a scale is the model's),
    ``statistics`` (reductions a decision reads), ``rescales`` (a cotangent multiplied by a
    decided scale on its own), ``model`` (the differentiated function's own backward: the
    kernels a plain ``jax.value_and_grad`` has too, with what rides in them). A kernel counts in
    the category of its largest result. The categories sum to ``kernels_run`` and
    ``kernel_bytes_run``. ``kernels``, if given, receives ``(kernel, category, bytes)`` of each
    kernel (a loop body's once)."""
    comps, fused, shapes, entry = _parse(text)
    frames = _frames(text)
    frame_of: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^\s+(?:ROOT )?%(\S+) = .*stack_frame_id=(\d+)", line)
        if m:
            frame_of[m.group(1)] = int(m.group(2))
    root_names = {m.group(1) for m in re.finditer(r"^\s+ROOT %(\S+) = ", text, re.MULTILINE)}

    def category(name: str, op: str, rest: str) -> str:
        sizes = [_array_bytes(f"{d}[{dims}]") for d, dims in _ARRAY.findall(shapes.get(name, ""))] or [0]
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        read = sum(_array_bytes(shapes.get(o, "")) for o in operands)
        if max(sizes) <= _SCALAR_OUT and read <= _SCALAR_READ:
            return "scalars"
        if _is_gemm(op, rest):  # (an epilogue may hold a rescale: the GEMM is the model's)
            return "model"
        target, body = name, {}
        if op == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", rest)
            body = {n: (o, r) for n, _, o, r in comps.get(called.group(1), ())} if called else {}
            root = next((n for n in body if n in root_names), None)
            target = root or name
            seen = 0
            while target in body and body[target][0] in _PASS_THROUGH and seen < 64:
                args = re.findall(r"%([\w.\-]+)", body[target][1].split(")", 1)[0])
                if not args:
                    break
                target = max(args, key=lambda a: _array_bytes(shapes.get(a, "")))
                seen += 1
        stack = frames.get(frame_of.get(target, frame_of.get(name, -1)), [])
        if _MERGE_FRAMES.intersection(stack):  # a rescaled sum, its max pass, or a plain sum
            inside = [frames.get(frame_of.get(n, -1), []) for n in body] if op == "fusion" else [stack]
            rescaled = any(_MERGE_FRAMES.intersection(st) and _MERGE_WORK.intersection(st) for st in inside)
            return "merges" if rescaled else "model"
        if _STAT_FRAMES.intersection(stack):
            return "statistics"
        if _RESCALE_FRAMES.intersection(stack) and not _MODEL_FRAMES.intersection(stack):
            return "rescales"
        return "model"

    own: dict[str, dict[str, list[int]]] = {}
    for comp, instrs in comps.items():
        if comp in fused:
            continue
        for name, _, op, rest in instrs:
            if op in _FREE:
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            gemm = _is_gemm(op, rest)
            called = re.search(r"calls=%([\w.\-]+)", rest) if op == "fusion" else None
            moved = _moved(comps, shapes, operands, name, called.group(1) if called else None,
                           workspace=gemm and op == "custom-call")
            cat = category(name, op, rest)
            if kernels is not None:
                kernels.append((name, cat, moved))
            counts = own.setdefault(cat, {}).setdefault(comp, [0, 0])
            counts[0] += 1
            counts[1] += moved
    out = {}
    for cat in CATEGORIES:
        k, b = _launched(comps, own.get(cat, {}), entry) if entry is not None else (0, 0)
        out[cat] = {"kernels": k, "bytes": b}
    return out

