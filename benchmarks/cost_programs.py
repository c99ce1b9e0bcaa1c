"""The programs whose cost :mod:`gpu_cost` reads from the compiled GPU program and
:mod:`gpu_step_time` times on a device: the depth benchmark's LM (:mod:`depth`) at the widths
people train, its gradient and training step under adaloss and under the baseline. No
environment is set here: :mod:`gpu_cost` compiles without a device, :mod:`gpu_step_time`
runs on one."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from depth import LM, train_steps

import jax_adaloss
from adaloss.config import AdaLossConfig

#: gradient format -> (the LM's compute dtype, the config)
CONFIGS = {"fp16": (jnp.float16, AdaLossConfig()),
           "bf16": (jnp.bfloat16, AdaLossConfig(grad_format="bfloat16")),
           "fp8": (jnp.float16, AdaLossConfig(grad_format="float8_e5m2")),
           "fp8-current": (jnp.float16, AdaLossConfig(grad_format="float8_e5m2", fp8_rule="current"))}
#: width -> the LM and its batch
WIDTHS = {"toy": {"vocab": 256, "dim": 128, "heads": 4, "seq": 64, "batch": 8, "blocks": 8},
          "gpt2": {"vocab": 32768, "dim": 768, "heads": 12, "seq": 1024, "batch": 8, "blocks": 4},
          "1b": {"vocab": 32768, "dim": 2048, "heads": 16, "seq": 2048, "batch": 4, "blocks": 2}}
KEYS = ("width", "config", "layout", "blocks", "program")
#: a config whose baseline is another's (the same model: fp8-current's is fp8's)
BASELINE_OF = {"fp8-current": "fp8"}


def programs(width: str, config: str, blocks: int, scanned: bool, concrete: bool = False
             ) -> dict[tuple[str, str], tuple[Any, tuple[Any, ...]]]:
    """(program, method) -> (function, its arguments) for one model: shapes only to compile
    (:mod:`gpu_cost`), or ``concrete`` arrays to run (:mod:`gpu_step_time`: initialized
    parameters and optimizer states, random tokens)."""
    dtype, cfg = CONFIGS[config]
    w = WIDTHS[width]
    model = LM(w["vocab"], w["dim"], w["heads"], blocks, scanned, dtype)
    shape = (w["batch"], w["seq"])
    if concrete:
        tokens = jax.random.randint(jax.random.key(1), (2, *shape), 0, w["vocab"], jnp.int32)
        x, y = tokens[0], tokens[1]
        params = jax.jit(model.init)(jax.random.key(0), x)
    else:
        x = y = jax.ShapeDtypeStruct(shape, jnp.int32)
        params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(shape, jnp.int32))

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    vg = jax_adaloss.value_and_grad(loss, config=cfg)
    steps = train_steps(loss, params, cfg, abstract=not concrete)
    return {("gradient", "adaloss"): (lambda p, x, y: vg(p, x, y, adaloss_state=None), (params, x, y)),
            ("gradient", "baseline"): (jax.value_and_grad(loss), (params, x, y)),
            ("step", "adaloss"): (steps["adaloss"][0], (*steps["adaloss"][1], x, y)),
            ("step", "baseline"): (steps["dynamic"][0], (*steps["dynamic"][1], x, y))}
