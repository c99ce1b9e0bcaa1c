"""The GPU program of our steps, compiled without a GPU: fp8 casts, FP8 GEMMs, kernels, bytes.

    pip install -e '.[gpu-program]' -e ./tools            # the CUDA plugin (no CUDA libraries)
    python benchmarks/gpu_program.py                      # docs/gpu_program.json, table printed
    python benchmarks/gpu_program.py --targets h100 --pipelines cublas --models mlp --dim 256

For the gradient step of the depth benchmark's LM (``--blocks``, unrolled and scanned; fp16) and
of a bf16 flax MLP (``--layers`` × Dense ``--dim`` + a 16-way head, batch
``--batch``, mean squared error in fp32), each method is compiled for each target (H100 SXM,
H200; :mod:`adaloss_tools.gpu_program`) in both GEMM pipelines XLA:GPU has without autotuning
(``triton``: its default; ``cublas``: Triton GEMMs off, what autotuning picks for many shapes on
a device), and the optimized program is read: converts to each fp8 format, GEMMs, those reading
an 8-bit operand, FP8 GEMMs (cuBLASLt f8 calls, GEMM fusions whose dot takes fp8 operands),
kernels, the bytes they move (each kernel's operands and results once), bytes accessed (XLA's
generic cost analysis), second passes (casts whose scale needed another kernel to reduce the
tensor first), temporary memory and compile time. The jaxpr's casts are the quantizations the
step asks for (XLA may merge identical ones and drop dead ones: the cotangent casts, one per
layer, can be neither), and ``own max`` those whose scale reads a reduction of their own tensor
(:func:`adaloss_tools.audit.fp8_casts`).

Methods: ``jax.value_and_grad`` (bf16, no fp8), flax ``Fp8DotGeneralOp`` (every Dense fp8 ×
fp8, delayed scaling), and ``jax_adaloss.value_and_grad`` with e5m2 gradients (``adaloss``), with
e4m3 operands too (``adaloss e4m3 operands``: every GEMM fp8 × fp8), per-tensor current scaling
(``current``: ``fp8_rule="current"``) and one scale (``one scale``: ``layer_rule=False``), with
bf16 and with e4m3 operands. No time is measured: nothing runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from adaloss_tools import gpu_program as gp

gp.environment()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

import jax_adaloss  # noqa: E402
from adaloss.config import AdaLossConfig  # noqa: E402
from adaloss_tools.audit import fp8_casts  # noqa: E402


class MLP(nn.Module):
    """``layers`` × (Dense ``dim``, relu) and a 16-way head, in bf16; ``fp8``: flax's FP8 dots."""

    dim: int
    layers: int
    fp8: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dot_general_cls": fp8_ops.Fp8DotGeneralOp} if self.fp8 else {}
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(self.dim, dtype=jnp.bfloat16, **kw)(x))
        return nn.Dense(16, dtype=jnp.bfloat16, **kw)(x)


ADALOSS = {
    "adaloss": {"grad_format": "float8_e5m2"},
    "current": {"grad_format": "float8_e5m2", "fp8_rule": "current"},
    "one scale": {"grad_format": "float8_e5m2", "layer_rule": False},
    "adaloss e4m3 operands": {"grad_format": "float8_e5m2", "operand_format": "float8_e4m3fn"},
    "current e4m3 operands": {"grad_format": "float8_e5m2", "operand_format": "float8_e4m3fn",
                              "fp8_rule": "current"},
    "one scale e4m3 operands": {"grad_format": "float8_e5m2", "operand_format": "float8_e4m3fn",
                                "layer_rule": False},
}


def lm_methods(blocks: int, scanned: bool) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """The depth benchmark's LM (:mod:`depth`: vocab 256, dim 128, 4 heads, seq 64, batch 8;
    fp16 compute): name -> (gradient step, its arguments); no flax FP8 variant."""
    import numpy as np
    from depth import LM
    model = LM(256, 128, 4, blocks, scanned)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 65)), jnp.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(0), x)

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    out = {"jax.value_and_grad": (jax.value_and_grad(loss), (params, x, y))}
    for name in ("adaloss", "current", "adaloss e4m3 operands"):
        out[name] = (_stateless(jax_adaloss.value_and_grad(loss, config=AdaLossConfig(**ADALOSS[name]))),
                     (params, x, y))
    return out


def methods(dim: int, layers: int, batch: int) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """The MLP's steps: name -> (gradient step, its arguments)."""
    x = jnp.ones((batch, dim), jnp.float32)
    y = jnp.ones((batch, 16), jnp.float32)

    def loss_of(model: nn.Module) -> Any:
        def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            return jnp.mean((model.apply(params, x).astype(jnp.float32) - y) ** 2)
        return loss

    plain, fp8 = MLP(dim, layers), MLP(dim, layers, fp8=True)
    params, fp8_params = plain.init(jax.random.key(0), x), fp8.init(jax.random.key(0), x)
    out = {"jax.value_and_grad": (jax.value_and_grad(loss_of(plain)), (params, x, y)),
           "flax Fp8DotGeneralOp": (jax.value_and_grad(loss_of(fp8)), (fp8_params, x, y))}
    for name, kw in ADALOSS.items():
        out[name] = (_stateless(jax_adaloss.value_and_grad(loss_of(plain), config=AdaLossConfig(**kw))),
                     (params, x, y))
    return out


def _stateless(vg: Any) -> Any:
    """adaloss's gradient step at its initial state (no back-off, no lifts)."""
    return lambda *args: vg(*args, adaloss_state=None)


def line(r: dict[str, Any]) -> str:
    """One printed row: the GPU program's converts / the jaxpr's casts per format, GEMMs,
    kernels, memory."""
    conv = " ".join(f"{f[2:]} {r['converts'][f]:3d}/{r['jaxpr_casts'][f]:<3d}" for f in gp.FP8_TYPES)
    passes = "/".join(str(r['second_passes'][f]) for f in gp.FP8_TYPES)
    return (f"{r['method']:24s} {r['target']} {r['pipeline']:6s} {conv} gemms {r['gemms']:3d} "
            f"reading fp8 {r['gemms_reading_fp8']:3d} fp8 {r['fp8_gemms']:3d} kernels {r['kernels']:4d} "
            f"MB {r['kernel_bytes'] / 1e6:7.1f} (XLA {r['bytes_accessed'] / 1e6:7.1f}) "
            f"second passes {passes} (own max {r['own_max']}) temp MB {r['temp_bytes'] / 1e6:6.1f} "
            f"compile {r['compile_s']:.2f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", choices=sorted(gp.TARGETS), default=sorted(gp.TARGETS))
    ap.add_argument("--pipelines", nargs="+", choices=gp.PIPELINES, default=list(gp.PIPELINES))
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--models", nargs="+", default=["mlp", "lm-unrolled", "lm-scanned"],
                    choices=("mlp", "lm-unrolled", "lm-scanned"))
    ap.add_argument("--blocks", type=int, default=8, help="the LM's")
    ap.add_argument("--json", type=Path, default=Path(__file__).parents[1] / "docs" / "gpu_program.json")
    args = ap.parse_args()
    rows = []
    for model in args.models:
        steps = (methods(args.dim, args.layers, args.batch) if model == "mlp"
                 else lm_methods(args.blocks, model == "lm-scanned"))
        for name, (fun, fargs) in steps.items():
            casts = gp.jaxpr_casts(fun, *fargs)
            own = sum(c.reads_own_max for c in fp8_casts(fun, *fargs))
            for target in args.targets:
                for pipeline in args.pipelines:
                    prog = gp.compile_for(fun, *fargs, target=target, pipeline=pipeline)
                    rows.append({"model": model, "method": name, "target": target, "pipeline": pipeline,
                                 "jaxpr_casts": casts, "own_max": own, **prog.row()})
                    print(model, line(rows[-1]), flush=True)
    payload = {"mlp": {"dim": args.dim, "layers": args.layers, "batch": args.batch},
               "lm": {"blocks": args.blocks},
               "jax": jax.__version__, "rows": rows}
    args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
