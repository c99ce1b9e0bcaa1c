"""Train the study's char-level GPT in JAX under one precision/scaling method.

Methods (the baselines are the libraries people use):

- ``fp32``: fp32 compute, no scaling (the reference);
- ``fp16``: fp16 compute, no loss scaling;
- ``static``: ``jmp.StaticLossScale(2^k)``;
- ``dynamic``: ``jmp.DynamicLossScale`` with GradScaler's defaults (2^16, ×2
  every 2000 clean steps, ÷2 and skip on overflow);
- ``dynamic-grow``: the same from 2^16 with its growth interval scaled to the run
  (``RunConfig.growth_interval``, steps/20 by default): a short run gives it the chance to
  grow that 2000 steps give it in a long one;
- ``adaloss-<model>``: :func:`jax_adaloss.value_and_grad` with the
  ``product``/``output``/``gradient`` statistical model, ``adaloss(inner=adam)``;
- ``cast-only``: the statistical cast decision alone (``layer_rule=False``): one global
  scale from the loss cotangent's statistics, no per-layer statistical scales;
- ``largest-safe``: per-layer scales that only the overflow caps decide (``u_min = 2^15``).

With an fp8 ``grad_format`` (``adaloss-study --grad-format float8_e5m2``) every method but
``fp32`` computes in bf16 and the gradients are fp8 wherever a method quantizes them:

- ``bf16``: bf16 compute, no quantization, no scaling;
- ``adaloss-<model>``, ``cast-only``: adaloss with ``grad_format`` (``cast-only``: one scale,
  the loss cotangent's);
- ``current``: ``fp8_rule="current"``, per-tensor current scaling (each cast's own max);
- ``delayed-16`` / ``delayed-1024``: flax's ``fp8_ops.out_qdq`` on every layer's output
  (:mod:`adaloss_zoo.fp8_delayed`), amax histories of 16 and 1024 steps, kept in the train state;
- ``fp32-cold``: fp32 whose step 0 applies no gradient (Adam still counts the step), as
  delayed scaling's cold start does when its scale of 1 flushes every cotangent: a zero first
  gradient damps Adam's next updates (its bias correction), a warm-up of its own.

``RunConfig.spike_at``: the loss ×``spike`` for ``spike_steps`` steps from that step (every
method), where a stale amax history mis-scales.

Adam's ε is ``adam_eps × loss_factor``: Adam is then invariant to the loss factor, so every
factor has the same fp32 reference (with a fixed ε = 1e-8, gradients of 1e-10 at ×1e-8
would turn Adam into slow SGD).

Every ``measure_every`` steps the per-layer underflow of the method's own
backward is measured against an fp32 backward at the same weights
(:mod:`jax_adaloss.underflow`).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from tqdm import tqdm

import jax_adaloss
from adaloss.config import AdaLossConfig
from jax_adaloss.underflow import compare_cotangents

METHODS = ("fp32", "fp16", "static", "dynamic", "dynamic-grow", "adaloss-product", "cast-only",
           "largest-safe", "adaloss-output", "adaloss-gradient", "bf16", "current", "delayed-16",
           "delayed-1024", "fp32-cold", "torchao-tensorwise", "torchao-rowwise", "adaloss-e2e")
#: what ``adaloss-study`` runs unless ``--methods`` says otherwise
DEFAULT_METHODS = METHODS[:8]
#: the same with an fp8 ``--grad-format``
FP8_METHODS = ("fp32", "bf16", "adaloss-product", "current", "delayed-16", "delayed-1024", "cast-only",
               "fp32-cold")
#: the same in PyTorch: torchao's float8 training instead of delayed scaling (torchao removed it)
TORCH_FP8_METHODS = ("fp32", "bf16", "adaloss-product", "adaloss-e2e", "current", "torchao-tensorwise",
                     "torchao-rowwise",
                     "cast-only", "fp32-cold")
#: the methods that only make sense with an fp8 ``grad_format`` (and those only without one)
_FP8_ONLY = ("current", "delayed-16", "delayed-1024", "torchao-tensorwise", "torchao-rowwise", "adaloss-e2e")
#: methods one framework has and the other has not
JAX_ONLY = ("delayed-16", "delayed-1024")
TORCH_ONLY = ("torchao-tensorwise", "torchao-rowwise")
_FP16_ONLY = ("fp16", "static", "dynamic", "dynamic-grow", "largest-safe")
GLOBAL_SCALES = ("static", "dynamic", "dynamic-grow")


def check_method(method: str, cfg: RunConfig, framework: str) -> None:
    """Refuse, naming the reason, a method this framework or this ``grad_format`` does not run."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if method in (TORCH_ONLY if framework == "jax" else JAX_ONLY):
        other = "torch" if framework == "jax" else "jax"
        raise ValueError(f"method {method!r} runs with --framework {other} only")
    if (method in _FP8_ONLY and not cfg.adaloss.fp8) or (method in _FP16_ONLY and cfg.adaloss.fp8):
        need = "an fp8 --grad-format" if method in _FP8_ONLY else "--grad-format float16"
        raise ValueError(f"method {method!r} needs {need} (got {cfg.adaloss.grad_format!r})")


def adaloss_config(method: str, base: AdaLossConfig) -> AdaLossConfig | None:
    """The :class:`AdaLossConfig` an adaptive ``method`` runs (``None`` for the others);
    ``adaloss-e2e``: the layers' inputs and weights in e4m3 too (every GEMM fp8 × fp8)."""
    if method == "adaloss-e2e":
        return dataclasses.replace(base, operand_format="float8_e4m3fn")
    if method.startswith("adaloss-"):
        return dataclasses.replace(base, model=method.split("-", 1)[1])
    if method == "cast-only":
        return dataclasses.replace(base, layer_rule=False)
    if method == "largest-safe":
        return dataclasses.replace(base, u_min=2.0**15)
    if method == "current":
        return dataclasses.replace(base, fp8_rule="current")
    return None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run's settings (shared by every method of a study)."""

    steps: int = 300
    batch: int = 16
    seq: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 2
    lr: float = 3e-3
    loss_factor: float = 1e-3  # multiplies the loss (see the README: a 1M-token mean)
    adam_eps: float = 1e-8  # Adam's ε at loss ×1; runs use adam_eps × loss_factor
    static_scale: float = 2.0**15
    growth_interval: int | None = None  # dynamic-grow's; None: max(1, steps // 20)
    measure_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    adaloss: AdaLossConfig = AdaLossConfig()
    spike_at: int | None = None  # the loss × ``spike`` for ``spike_steps`` steps from this step
    spike: float = 1000.0
    spike_steps: int = 10

    def factor(self, step: int) -> float:
        """The spike's factor at ``step`` (1 outside the spike)."""
        on = self.spike_at is not None and self.spike_at <= step < self.spike_at + self.spike_steps
        return self.spike if on else 1.0

    def compute_dtype(self, method: str) -> Any:
        """fp32 for ``fp32``; bf16 with an fp8 ``grad_format`` (and for ``bf16``); else fp16."""
        if method in ("fp32", "fp32-cold"):
            return jnp.float32
        return jnp.bfloat16 if self.adaloss.fp8 or method == "bf16" else jnp.float16

    @property
    def eps(self) -> float:
        """Adam's ε for this loss factor (the optimizer then ignores the factor)."""
        return self.adam_eps * self.loss_factor

    @property
    def growth(self) -> int:
        """``dynamic-grow``'s growth interval."""
        return self.growth_interval if self.growth_interval is not None else max(1, self.steps // 20)


@dataclasses.dataclass
class RunResult:
    """One run's record, filled in as the run goes (both frameworks)."""

    method: str
    train_loss: list[float] = dataclasses.field(default_factory=list)  # per step, ÷ loss_factor
    val_loss: float = float("nan")
    skipped: int = 0
    step_ms: float = float("nan")  # median of step_seconds (the first, compiling, step left out)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    # step -> layer -> fraction the scale leaves below u_min (LayerUnderflow.measured), held
    # below u_min as carried (.carried), at zero (.flushed)
    underflow: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    carried: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    flushed: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    predicted: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)  # step -> layer -> rate
    # step -> layer -> scale (adaloss) or {"global": S}
    scales: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    # step -> adaloss decisions whose scale a cap or bound set, below the statistical scale
    limited: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    # step -> adaloss layers whose incoming scale such a decision set (a larger one not available)
    held: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    # fp8, adaloss methods: step -> layer -> fraction of its cast's non-zero entries flushed to
    # zero / saturated (every step)
    fp8_flushed: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    fp8_saturated: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    # adaloss methods: cast decision -> what it casts (dtypes, shape, where)
    casts: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def val_ppl(self) -> float:
        return float(np.exp(self.val_loss))

    def add_step(self, seconds: float, loss: float, skipped: bool) -> None:
        self.step_seconds.append(seconds)
        self.train_loss.append(loss)
        self.skipped += int(skipped)

    def add_underflow(self, step: int, got: dict[str, Any]) -> None:
        """``got``: layer -> :class:`adaloss.report.LayerUnderflow`."""
        self.underflow[step] = {k: u.measured for k, u in got.items()}
        self.carried[step] = {k: u.carried for k, u in got.items()}
        self.flushed[step] = {k: u.flushed for k, u in got.items()}
        self.predicted[step] = {k: u.predicted for k, u in got.items()}

    def finish(self, val_loss: float) -> RunResult:
        self.val_loss = val_loss
        self.step_ms = 1e3 * statistics.median(self.step_seconds[1:] or self.step_seconds)
        return self


def _loss_fn(graphdef: Any, factor: float) -> Callable[..., jax.Array]:
    def loss(params: Any, x: jax.Array, y: jax.Array, scale: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(x).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -scale * factor * jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))
    return loss


class Trainer:
    """One method's model, optimizer state and jitted training step (no host sync in :meth:`step`).

    ``telemetry``: the step also returns the scales (and which decisions a bound
    limited); off, it returns what a training loop needs (for timing).
    """

    def __init__(self, method: str, cfg: RunConfig, make_model: Callable[[Any, Any, int], Any],
                 telemetry: bool = True) -> None:
        check_method(method, cfg, "jax")
        self.method, self.cfg = method, cfg
        dtype = cfg.compute_dtype(method)
        graphdef, self.params = nnx.split(make_model(cfg, dtype, cfg.seed))
        ref_graph, _ = nnx.split(make_model(cfg, jnp.float32, cfg.seed))
        self.loss = _loss_fn(graphdef, cfg.loss_factor)
        self.ref_loss = _loss_fn(ref_graph, cfg.loss_factor)
        self.ada_cfg = adaloss_config(method, cfg.adaloss)
        if self.ada_cfg is not None:
            self._step, self.state = _adaloss_step(self.loss, self.ada_cfg, cfg, self.params, telemetry)
        elif method.startswith("delayed-"):
            self._step, self.state = _delayed_step(self.loss, method, cfg, self.params)
        else:
            self._step, self.state = _global_step(self.loss, method, cfg, self.params, telemetry)

    def step(self, x: Any, y: Any, factor: float = 1.0) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """One training step, the loss × ``factor`` (a spike): (loss, skipped, scales) as device
        arrays."""
        if callable(self.state):  # delayed scaling: its metas need a batch to count the layers
            self.state = self.state(x, y)
        self.params, self.state, value, scales, skip = self._step(self.params, self.state, x, y,
                                                                  np.float32(factor))
        return value, skip, scales

    def global_scale(self) -> jax.Array:
        """The current global loss scale (1 for fp16/fp32)."""
        scaler = self.state[1] if self.method in GLOBAL_SCALES else None
        return jnp.asarray(scaler.loss_scale if scaler is not None else 1.0, jnp.float32)


_ONE = np.float32(1.0)


def _adaloss_step(loss: Callable[..., jax.Array], config: AdaLossConfig, cfg: RunConfig, params: Any,
                  telemetry: bool) -> Any:
    """The adaloss step."""
    tx = jax_adaloss.adaloss(inner=optax.adam(cfg.lr, eps=cfg.eps))
    vg = jax_adaloss.value_and_grad(loss, config=config, return_report=True)

    @jax.jit
    def step(params: Any, opt_state: Any, x: Any, y: Any, factor: Any) -> Any:
        # adaloss_state: the back-off after skipped steps
        (value, grads), report = vg(params, x, y, factor, adaloss_state=opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        scales = {}
        if telemetry:
            for k, r in report.layers.items():
                scales[k], scales[f"{k}#limited"] = r.scale, r.unrounded_scale < r.model_scale
                scales[f"{k}#held"] = r.incoming_held
                if r.flushed is not None:
                    scales[f"{k}#flushed"], scales[f"{k}#saturated"] = r.flushed, r.saturated
            scales["#casts"] = report.casts  # static: what each cast casts
        return optax.apply_updates(params, updates), opt_state, value / factor, scales, jnp.zeros((), bool)
    return step, tx.init(params)


def _delayed_step(loss: Callable[..., jax.Array], method: str, cfg: RunConfig, params: Any) -> Any:
    """Adam on gradients whose every layer-output cotangent went through flax's
    ``fp8_ops.out_qdq`` at its delayed scale; the metas (scales, amax histories) ride in the state,
    created at the first batch (a callable until then); a non-finite step is skipped (the metas
    still advance, as in flax and Transformer Engine)."""
    from adaloss_zoo.fp8_delayed import count_layers, delayed_value_and_grad, init_metas

    adam = optax.adam(cfg.lr, eps=cfg.eps)
    history = int(method.split("-", 1)[1])
    q_dtype = jnp.dtype(cfg.adaloss.grad_format)

    def init(x: Any, y: Any) -> Any:
        n = count_layers(lambda p: (loss(p, x, y, _ONE), None), params)
        return adam.init(params), init_metas(n, history)

    @jax.jit
    def step(params: Any, state: Any, x: Any, y: Any, factor: Any) -> Any:
        opt_state, metas = state
        run = delayed_value_and_grad(lambda p: (loss(p, x, y, factor), None), q_dtype)
        (value, _), grads, metas = run(params, metas)
        finite = jmp.all_finite(grads)
        updates, new_opt = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt), (params, opt_state))
        return params, (opt_state, metas), value / factor, {}, ~finite
    return step, init


def _global_step(loss: Callable[..., jax.Array], method: str, cfg: RunConfig, params: Any,
                 telemetry: bool) -> Any:
    adam = optax.adam(cfg.lr, eps=cfg.eps)
    if method == "static":
        scale0 = jmp.StaticLossScale(jnp.float32(cfg.static_scale))
    elif method == "dynamic":
        scale0 = jmp.DynamicLossScale(jnp.float32(2.0**16))
    elif method == "dynamic-grow":
        scale0 = jmp.DynamicLossScale(jnp.float32(2.0**16), period=cfg.growth)
    else:
        scale0 = jmp.NoOpLossScale()

    @jax.jit
    def step(params: Any, state: Any, x: Any, y: Any, factor: Any) -> Any:
        opt_state, ls = state
        value, grads = jax.value_and_grad(lambda p: ls.scale(loss(p, x, y, factor)))(params)
        grads = ls.unscale(grads)
        if method == "fp32-cold":  # no gradient at step 0; Adam's count still advances
            first = optax.tree.get(opt_state, "count") == 0
            grads = jax.tree.map(lambda g: jnp.where(first, jnp.zeros_like(g), g), grads)
        finite = jmp.all_finite(grads)
        updates, new_opt = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt), (params, opt_state))
        loss_value = ls.unscale(value) / factor  # by the scale this step used, before it adjusts
        if isinstance(ls, jmp.DynamicLossScale):
            ls = ls.adjust(finite)
        scale = ls.loss_scale if not isinstance(ls, jmp.NoOpLossScale) else _ONE
        scales = {"global": jnp.asarray(scale, jnp.float32)} if telemetry else {}
        return params, (opt_state, ls), loss_value, scales, ~finite
    return step, (adam.init(params), scale0)


def run(method: str, cfg: RunConfig, data: Iterator[tuple[np.ndarray, np.ndarray]],
        val: list[tuple[np.ndarray, np.ndarray]], make_model: Callable[[Any, Any, int], Any],
        progress: bool = True) -> RunResult:
    """Train ``cfg.steps`` steps of ``method``; ``data`` yields (x, y) batches and
    ``make_model(cfg, dtype, seed)`` builds the Flax nnx model."""
    t = Trainer(method, cfg, make_model)
    eval_loss = jax.jit(lambda p, x, y: t.loss(p, x, y, _ONE))
    capture_adaptive = functools.partial(jax_adaloss.layer_cotangents, t.loss, config=t.ada_cfg)
    capture_global = functools.partial(jax_adaloss.layer_cotangents, t.loss, config=cfg.adaloss)
    capture_ref = functools.partial(jax_adaloss.layer_cotangents, t.ref_loss, loss_scale=1.0,
                                    config=cfg.adaloss)

    res = RunResult(method)
    for i in tqdm(range(cfg.steps), desc=method, leave=False, disable=None if progress else True):
        x, y = next(data)
        factor = cfg.factor(i)
        # fp8: the casts report their own fractions every step (the underflow measurement compares
        # 16-bit cotangents with an fp32 backward's)
        measure = cfg.measure_every and i % cfg.measure_every == 0
        if method not in ("fp32", "fp32-cold") and not cfg.adaloss.fp8 and measure:
            if t.ada_cfg is not None:  # with the run's back-off and lifts
                low = capture_adaptive(t.params, x, y, _ONE, state=t.state)
            else:
                # the global scale seeds the backward, so that the cotangents carry it
                low = capture_global(t.params, x, y, _ONE, loss_scale=float(t.global_scale()))
            got = compare_cotangents(low, capture_ref(t.params, x, y, _ONE), cfg.adaloss)
            res.add_underflow(i, got)
        t0 = time.perf_counter()
        value, skip, step_scales = t.step(x, y, factor)
        jax.block_until_ready(value)
        res.add_step(time.perf_counter() - t0, float(value) / cfg.loss_factor, bool(skip))
        if "#casts" in step_scales:
            res.casts = step_scales.pop("#casts").as_dict()
        if cfg.adaloss.fp8 and step_scales:
            res.fp8_flushed[i] = {k.removesuffix("#flushed"): float(v) for k, v in step_scales.items()
                                  if k.endswith("#flushed")}
            res.fp8_saturated[i] = {k.removesuffix("#saturated"): float(v) for k, v in step_scales.items()
                                    if k.endswith("#saturated")}
        near_spike = cfg.spike_at is not None and cfg.spike_at - 1 <= i < cfg.spike_at + 2 * cfg.spike_steps
        if i % max(1, cfg.measure_every) == 0 or i == cfg.steps - 1 or near_spike:
            res.scales[i] = {k: float(v) for k, v in step_scales.items() if "#" not in k}
            res.limited[i] = sorted(k.removesuffix("#limited") for k, v in step_scales.items()
                                if k.endswith("#limited") and bool(v))
            res.held[i] = sorted(k.removesuffix("#held") for k, v in step_scales.items()
                             if k.endswith("#held") and bool(v))
    val_loss = float(np.mean([float(eval_loss(t.params, x, y)) for x, y in val])) / cfg.loss_factor
    if t.ada_cfg is not None:
        res.skipped = int(optax.tree.get(t.state, "skipped"))  # counted by the transformation
    return res.finish(val_loss)
