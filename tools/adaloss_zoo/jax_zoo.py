"""JAX models written the way their libraries' documentation writes them.

- ``linen-cnn``: the Flax docs' CNN (Conv → relu → avg_pool, twice, Dense, Dense)
  with BatchNorm and Dropout, trained through ``flax.training.train_state.TrainState``
  by the canonical ``train_step``: ``loss_fn(params)`` closes over the batch, the
  batch statistics and the dropout key, ``has_aux=True``,
  ``mutable=['batch_stats']``.
- ``linen-transformer``: a causal LM from linen's ``Embed``,
  ``MultiHeadDotProductAttention``, ``LayerNorm``, ``Dense`` and ``Dropout``, same step.
- ``nnx-bn-dropout``: an nnx CNN with BatchNorm and Dropout, trained in ``nnx.jit``
  with ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, the gradient taken by passing the
  Module, as to ``nnx.value_and_grad``.
- ``equinox-mlp``: an ``eqx.nn.MLP``, fp32 parameters cast to fp16 for the
  forward (``jmp``'s ``cast_to_compute``), split with ``eqx.partition``.

Every model computes in fp16 with fp32 parameters. :meth:`JaxCase.grads` runs one
backward of the same fp16 forward under a method (``reference``: that forward's
backward computed in fp32, loss ×1: its exact gradient, which fp16 weight gradients
miss by their rounding; ``fp16``: ``jax.grad`` of the loss × factor; ``static``: a fixed
loss scale, ``jmp.StaticLossScale(2**15)``; ``adaloss``) inside ``jax.jit``, the
batch closed over, and returns fp64 NumPy gradients divided by the factor.
:meth:`JaxCase.train` runs the library's own training step with only the
gradient function and the optimizer swapped for adaloss's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jax_adaloss
from adaloss.config import AdaLossConfig
from adaloss_zoo.metrics import largest_finite_power
from jax_adaloss.api import _value_and_grad

F16 = jnp.float16
STATIC_SCALE = 2.0**15
METHODS = ("reference", "fp16", "static", "adaloss")


def _names(tree: Any) -> dict[str, np.ndarray]:
    """``{path: fp64 array}`` of a gradient tree (an nnx Variable's ``/value`` left out)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        out[re.sub(r"/value$", "", name)] = np.asarray(leaf, np.float64)
    return out


def _layer_names(report: Any) -> Counter[str]:
    return Counter(re.sub(r"@\d+$", "", k) for k in report.layers if not k.startswith("cast:"))


@dataclasses.dataclass
class Grads:
    """One backward: gradients (÷ factor, fp64) by parameter path, and adaloss's report."""

    grads: dict[str, np.ndarray]
    report: Any = None

    @property
    def layers(self) -> Counter[str]:
        return Counter() if self.report is None else _layer_names(self.report)


def _method_value_and_grad(method: str, factor: float, config: AdaLossConfig | None,
                           transform: Callable[..., Any], scale: float = STATIC_SCALE,
                           backoff: int = 0) -> Callable[[Callable[..., Any]], Any]:
    """A ``value_and_grad``-like wrapper for ``loss(x) -> (scalar, aux)`` that returns
    ``(aux, gradients unscaled and divided by factor, report or None)``; ``scale`` is the
    ``static`` method's loss scale, ``backoff`` adaloss's back-off exponent."""
    def wrap(loss: Callable[..., Any]) -> Callable[..., Any]:
        if method == "adaloss":
            vg = jax_adaloss.value_and_grad(lambda x: _times(loss(x), factor), has_aux=True,
                                            config=config, return_report=True)
            state = jax_adaloss.adaloss(config).init({})._replace(backoff=jnp.int32(backoff))

            def run(x: Any) -> Any:
                ((_, aux), g), rep = vg(x, adaloss_state=state)
                return aux, jax.tree.map(lambda a: a / factor, jax_adaloss.unscale_tree(g)), rep
            return run
        if method == "reference":  # the same 16-bit forward, its backward in fp32
            vg = _value_and_grad(lambda x: _times(loss(x), 1.0), 0, True, config=config, reference="fp32")

            def run_ref(x: Any) -> Any:
                (_, aux), g = vg(x)
                return aux, jax_adaloss.unscale_tree(g), None
            return run_ref
        if method == "fp16":
            f = factor
        elif method == "static":
            ls, f = jmp.StaticLossScale(jnp.asarray(scale, jnp.float32)), factor
        else:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "fp16":
            ls = jmp.NoOpLossScale()
        vg = transform(lambda x: _times(loss(x), f, ls.scale), has_aux=True)

        def run(x: Any) -> Any:
            (_, aux), g = vg(x)
            g = jax.tree.map(lambda a: a.astype(jnp.float32), g)
            return aux, jax.tree.map(lambda a: a / f, ls.unscale(g)), None
        return run
    return wrap


def _times(out: tuple[Any, Any], factor: float, scale: Callable[[Any], Any] = lambda v: v
           ) -> tuple[Any, Any]:
    return scale(out[0] * factor), out[1]


#: the global dynamic baseline's initial scale: GradScaler's default
DYNAMIC_INIT = 2.0**16


def _optimizer(dynamic: bool) -> optax.GradientTransformation:
    """Adam (lr 1e-3) behind adaloss, or (``dynamic``) behind ``optax.apply_if_finite``, the
    skip that goes with ``jmp.DynamicLossScale``."""
    if dynamic:
        return optax.apply_if_finite(optax.adam(1e-3), max_consecutive_errors=2**31 - 1)
    return jax_adaloss.adaloss(inner=optax.adam(1e-3))


def _skipped(opt_state: Any, dynamic: bool) -> int:
    return int(optax.tree.get(opt_state, "total_notfinite" if dynamic else "skipped"))


def _initial_loss_scale() -> tuple[jax.Array, jax.Array]:
    """``jmp.DynamicLossScale``'s arrays (scale, counter) at :data:`DYNAMIC_INIT`: passed as a
    tuple, since ``nnx.jit`` and ``eqx.filter_jit`` rebuild pytree arguments with ``None``
    leaves, which jmp's constructor refuses."""
    return jnp.float32(DYNAMIC_INIT), jnp.zeros((), jnp.int32)


def _jmp_value_and_grad(loss_fn: Callable[..., Any], ls: tuple[jax.Array, jax.Array],
                        grad: Callable[..., Any] = jax.grad) -> Callable[..., Any]:
    """jmp's documented step for ``loss_fn(x) -> (loss, aux)``: scale the loss by a
    ``jmp.DynamicLossScale`` (its arrays ``ls``), differentiate, unscale, check finiteness,
    adjust: ``((loss, aux), grads, the adjusted scale's arrays)``."""
    scale = jmp.DynamicLossScale(*ls)

    def run(x: Any) -> Any:
        def scaled(x: Any) -> Any:
            loss, aux = loss_fn(x)
            return scale.scale(loss), (loss, aux)
        grads, (loss, aux) = grad(scaled, has_aux=True)(x)
        grads = scale.unscale(grads)
        new = scale.adjust(jmp.all_finite(grads))
        return (loss, aux), grads, (new.loss_scale, new.counter)
    return run


def skip_flags(counts: list[int]) -> list[bool]:
    """Per step, whether it was skipped, from the running skip counter after each step."""
    return [b > a for a, b in zip([0, *counts[:-1]], counts)]


class JaxCase:
    """A zoo model: :meth:`grads` (one backward under a method), :meth:`train` (the idiom)."""

    name: str
    #: layers adaptive scaling must find: every Dense/Conv whose input needs a gradient
    expected: Counter[str]
    #: parameters with an analytically zero gradient (their reference is rounding noise)
    exclude: tuple[str, ...] = ()

    def grads(self, method: str, factor: float, config: AdaLossConfig | None = None,
              scale: float = STATIC_SCALE, backoff: int = 0) -> Grads:
        """One backward of the fp16 forward under ``method`` (``scale``: the static one's,
        ``backoff``: adaloss's back-off exponent)."""
        raise NotImplementedError

    def objective(self) -> tuple[Callable[[Any], tuple[jax.Array, Any]], Any]:
        """``(loss, x)``: the training step's ``loss(x) -> (scalar, aux)`` on the case's batch
        and what it differentiates (a parameter tree, or the nnx Module)."""
        raise NotImplementedError

    def adaloss(self, factor: float, config: AdaLossConfig | None = None, max_tries: int = 32
                ) -> tuple[Grads, int]:
        """adaloss repeated on the same batch until a backward is finite, its back-off exponent
        raised after each non-finite one (as a skipped step does): gradients, passes skipped."""
        for tries in range(max_tries):
            g = self.grads("adaloss", factor, config, backoff=tries)
            if all(np.isfinite(v).all() for v in g.grads.values()):
                return g, tries
        return g, max_tries

    def dynamic(self, factor: float, max_tries: int = 32) -> tuple[Grads, int]:
        """``jmp.DynamicLossScale`` started at 2^16 (as GradScaler), repeated on the same batch
        until a backward is finite: its gradients and the backward passes skipped before."""
        ls = jmp.DynamicLossScale(jnp.float32(2.0**16))
        for tries in range(max_tries):
            g = self.grads("static", factor, scale=float(ls.loss_scale))
            finite = all(np.isfinite(v).all() for v in g.grads.values())
            if finite:
                return g, tries
            ls = ls.adjust(jnp.asarray(finite))
        return g, max_tries

    def converged(self, factor: float) -> tuple[int, Grads]:
        """A global dynamic scale given the time to grow: the largest finite power-of-two
        scale ``2^k`` (:func:`adaloss_zoo.metrics.largest_finite_power`), ``k`` and its gradients."""
        def at(k: int) -> tuple[bool, Grads]:
            g = self.grads("static", factor, scale=2.0**k)
            return all(np.isfinite(v).all() for v in g.grads.values()), g
        return largest_finite_power(at)

    def train(self, steps: int, factor: float, config: AdaLossConfig | None = None,
              dynamic: bool = False) -> dict[str, Any]:
        """``steps`` of the library's training step with adaloss (``dynamic``: with
        ``jmp.DynamicLossScale`` from :data:`DYNAMIC_INIT` and ``optax.apply_if_finite``
        instead): the losses (÷ factor), the skipped steps and which ones (``skip_flags``),
        the optimizer's step count and the paths of the non-differentiated state (batch
        statistics, RNG counts) that changed."""
        raise NotImplementedError


# -- Flax linen, TrainState ---------------------------------------------------------------
class LinenCNN(nn.Module):
    """The Flax docs' CNN, tiny, with BatchNorm and Dropout."""

    dtype: Any = F16

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(features=8, kernel_size=(3, 3), dtype=self.dtype)(x)
        x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=16, kernel_size=(3, 3), dtype=self.dtype)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=32, dtype=self.dtype)(x)
        x = nn.relu(x)
        x = nn.Dropout(rate=0.1, deterministic=not train)(x)
        return nn.Dense(features=10, dtype=self.dtype)(x)


class LinenLM(nn.Module):
    """A one-block causal transformer LM from linen's layers."""

    vocab: int = 64
    dim: int = 32
    heads: int = 4
    dtype: Any = F16

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool) -> jax.Array:
        h = nn.Embed(self.vocab, self.dim, dtype=self.dtype)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        h = h + pos.astype(self.dtype)
        y = nn.LayerNorm(dtype=self.dtype)(h)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype, dropout_rate=0.1,
                                            deterministic=not train)(y, mask=nn.make_causal_mask(tokens))
        h = h + y
        y = nn.LayerNorm(dtype=self.dtype)(h)
        y = nn.Dense(4 * self.dim, dtype=self.dtype)(y)
        y = nn.Dropout(rate=0.1, deterministic=not train)(nn.gelu(y))
        h = h + nn.Dense(self.dim, dtype=self.dtype)(y)
        return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(h))


class TrainState(train_state.TrainState):
    batch_stats: Any = None
    key: jax.Array = None  # the dropout key, as in the Flax docs


_LOGITS = [1.0]  # the logit multiplier of the traces made inside ``logit_scale``


@contextlib.contextmanager
def logit_scale(k: float) -> Iterator[None]:
    """Multiply every zoo model's fp32 logits by ``k`` before the loss while tracing inside
    (``k = 10, 30``: a confident softmax, probabilities down to e^-(k·spread))."""
    _LOGITS.append(float(k))
    try:
        yield
    finally:
        _LOGITS.pop()


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The Flax docs' loss, on logits upcast to fp32 (the mixed-precision custom), times the
    current :func:`logit_scale`."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits.astype(jnp.float32) * _LOGITS[-1], labels=labels).mean()


class LinenCase(JaxCase):
    def __init__(self, name: str, module: nn.Module, batch: dict[str, jax.Array], expected: Counter[str],
                 seed: int = 0, exclude: tuple[str, ...] = ()) -> None:
        self.name, self.module, self.batch, self.expected = name, module, batch, expected
        self.exclude = exclude
        key, dropout_key = jax.random.split(jax.random.key(seed))
        variables = module.init(key, batch["x"], train=False)
        self.params = variables["params"]
        self.batch_stats = variables.get("batch_stats", {})
        self.dropout_key = dropout_key

    def _loss(self, batch_stats: Any, batch: dict[str, jax.Array], key: jax.Array) -> Callable[..., Any]:
        def loss_fn(params: Any) -> tuple[jax.Array, Any]:
            logits, updates = self.module.apply(
                {"params": params, "batch_stats": batch_stats}, batch["x"], train=True,
                rngs={"dropout": key}, mutable=["batch_stats"])
            return _xent(logits, batch["y"]), updates
        return loss_fn

    def objective(self) -> tuple[Callable[[Any], tuple[jax.Array, Any]], Any]:
        return self._loss(self.batch_stats, self.batch, self.dropout_key), self.params

    def grads(self, method: str, factor: float, config: AdaLossConfig | None = None,
              scale: float = STATIC_SCALE, backoff: int = 0) -> Grads:
        vg = _method_value_and_grad(method, factor, config, jax.value_and_grad, scale, backoff)

        @jax.jit
        def step(params: Any, batch_stats: Any, batch: Any, key: jax.Array) -> Any:
            return vg(self._loss(batch_stats, batch, key))(params)

        _, g, rep = step(self.params, self.batch_stats, self.batch, self.dropout_key)
        return Grads(_names(g), rep)

    def train(self, steps: int, factor: float, config: AdaLossConfig | None = None,
              dynamic: bool = False) -> dict[str, Any]:
        state = TrainState.create(apply_fn=self.module.apply, params=self.params, tx=_optimizer(dynamic),
                                  batch_stats=self.batch_stats, key=self.dropout_key)

        @jax.jit
        def train_step(state: TrainState, ls: Any, batch: dict[str, jax.Array]) -> Any:
            dropout_key = jax.random.fold_in(key=state.key, data=state.step)

            def loss_fn(params: Any) -> tuple[jax.Array, Any]:
                logits, updates = state.apply_fn(
                    {"params": params, "batch_stats": state.batch_stats}, batch["x"], train=True,
                    rngs={"dropout": dropout_key}, mutable=["batch_stats"])
                return factor * _xent(logits, batch["y"]), updates

            if dynamic:
                (loss, updates), grads, ls = _jmp_value_and_grad(loss_fn, ls)(state.params)
            else:
                grad_fn = jax_adaloss.value_and_grad(loss_fn, has_aux=True, config=config)
                (loss, updates), grads = grad_fn(state.params, adaloss_state=state.opt_state)
            state = state.apply_gradients(grads=grads)
            return state.replace(batch_stats=updates.get("batch_stats", state.batch_stats)), ls, loss

        losses, counts = [], []
        ls = _initial_loss_scale()
        for _ in range(steps):
            state, ls, loss = train_step(state, ls, self.batch)
            losses.append(float(loss) / factor)
            counts.append(_skipped(state.opt_state, dynamic))
        return {"losses": losses, "skipped": counts[-1], "skip_flags": skip_flags(counts),
                "state_changed": _changed(self.batch_stats, state.batch_stats), "step": int(state.step)}


def linen_cnn(seed: int = 0, dtype: Any = F16) -> LinenCase:
    key = jax.random.key(100 + seed)
    batch = {"x": jax.random.normal(key, (8, 12, 12, 1)), "y": jnp.arange(8) % 10}
    # the first conv sees the images alone: its input needs no gradient
    expected = Counter({"Conv_1/kernel": 1, "Dense_0/kernel": 1, "Dense_1/kernel": 1})
    # the first conv's bias feeds BatchNorm, which subtracts the batch mean: zero gradient
    return LinenCase("linen-cnn", LinenCNN(dtype=dtype), batch, expected, seed, exclude=("Conv_0/bias",))


def linen_transformer(seed: int = 0, dtype: Any = F16) -> LinenCase:
    key = jax.random.key(200 + seed)
    tokens = jax.random.randint(key, (4, 16), 0, 64)
    batch = {"x": tokens, "y": jnp.roll(tokens, -1, axis=1)}
    mha = "MultiHeadDotProductAttention_0"
    expected = Counter({f"{mha}/{k}/kernel": 1 for k in ("query", "key", "value", "out")}
                       | {f"Dense_{i}/kernel": 1 for i in range(3)})
    # the key bias shifts every attention logit of a query equally: softmax ignores it
    return LinenCase("linen-transformer", LinenLM(dtype=dtype), batch, expected, seed,
                     exclude=(f"{mha}/key/bias",))


# -- Flax nnx -------------------------------------------------------------------------------
class NnxCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype: Any = F16) -> None:
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(8, dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear1 = nnx.Linear(16 * 3 * 3, 32, dtype=dtype, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.bn(self.conv1(x))), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


class NnxCase(JaxCase):
    def __init__(self, seed: int = 0, dtype: Any = F16) -> None:
        self.name = "nnx-bn-dropout"
        self.seed, self.dtype = seed, dtype
        key = jax.random.key(300 + seed)
        self.batch = {"x": jax.random.normal(key, (8, 12, 12, 1)), "y": jnp.arange(8) % 10}
        self.expected = Counter({"conv2/kernel": 1, "linear1/kernel": 1, "linear2/kernel": 1})
        self.exclude = ("conv1/bias",)  # feeds BatchNorm: zero gradient

    def model(self) -> NnxCNN:
        return NnxCNN(nnx.Rngs(self.seed), self.dtype)

    def objective(self) -> tuple[Callable[[Any], tuple[jax.Array, Any]], Any]:
        def loss_fn(model: NnxCNN) -> tuple[jax.Array, None]:
            return _xent(model(self.batch["x"]), self.batch["y"]), None
        return loss_fn, self.model()

    def grads(self, method: str, factor: float, config: AdaLossConfig | None = None,
              scale: float = STATIC_SCALE, backoff: int = 0) -> Grads:
        model = self.model()
        transform = nnx.value_and_grad
        vg = _method_value_and_grad(method, factor, config, transform, scale, backoff)

        @nnx.jit
        def step(model: NnxCNN, batch: dict[str, jax.Array]) -> Any:
            def loss_fn(model: NnxCNN) -> tuple[jax.Array, None]:
                return _xent(model(batch["x"]), batch["y"]), None
            return vg(loss_fn)(model)

        _, g, rep = step(model, self.batch)
        return Grads(_names(g), rep)

    def train(self, steps: int, factor: float, config: AdaLossConfig | None = None,
              dynamic: bool = False) -> dict[str, Any]:
        model = self.model()
        optimizer = nnx.Optimizer(model, _optimizer(dynamic), wrt=nnx.Param)
        before = _snapshot(nnx.state(model, nnx.Not(nnx.Param)))

        @nnx.jit
        def train_step(model: NnxCNN, optimizer: nnx.Optimizer, ls: Any, batch: dict[str, jax.Array]) -> Any:
            def loss_fn(model: NnxCNN) -> jax.Array:
                return factor * _xent(model(batch["x"]), batch["y"])
            if dynamic:
                (loss, _), grads, ls = _jmp_value_and_grad(lambda m: (loss_fn(m), None), ls, nnx.grad)(model)
            else:
                loss, grads = jax_adaloss.value_and_grad(loss_fn, config=config)(
                    model, adaloss_state=optimizer.opt_state)
            optimizer.update(model, grads)
            return loss, ls

        losses, counts = [], []
        ls = _initial_loss_scale()
        for _ in range(steps):
            loss, ls = train_step(model, optimizer, ls, self.batch)
            losses.append(float(loss) / factor)
            counts.append(_skipped(optimizer.opt_state, dynamic))
        after = _snapshot(nnx.state(model, nnx.Not(nnx.Param)))
        return {"losses": losses, "skipped": counts[-1], "skip_flags": skip_flags(counts),
                "state_changed": _changed(before, after), "step": int(optimizer.step[...])}


def _changed(before: Any, after: Any) -> list[str]:
    """Paths of the non-differentiated state whose values changed."""
    b, a = _names(before), _names(after)
    return sorted(k for k in b if np.any(b[k] != a[k]))


def _snapshot(state: Any) -> Any:
    """Copies of a state's values (key arrays as their raw data), to compare before/after."""
    def copy(x: Any) -> Any:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)
    return jax.tree.map(copy, state)


# -- Equinox --------------------------------------------------------------------------------
def _cast_to_compute(tree: Any, dtype: Any = F16) -> Any:
    name = jnp.dtype(dtype).name
    return jmp.get_policy(f"params=float32,compute={name},output=float32").cast_to_compute(tree)


class EquinoxCase(JaxCase):
    def __init__(self, seed: int = 0, dtype: Any = F16) -> None:
        self.name = "equinox-mlp"
        self.dtype = dtype
        key, kx = jax.random.split(jax.random.key(400 + seed))
        self.model = eqx.nn.MLP(in_size=16, out_size=10, width_size=32, depth=2, key=key)
        self.batch = {"x": jax.random.normal(kx, (8, 16)), "y": jnp.arange(8) % 10}
        self.expected = Counter({"layers/1/weight": 1, "layers/2/weight": 1})

    def _loss(self, static: Any, batch: dict[str, jax.Array]) -> Callable[..., Any]:
        def loss_fn(params: Any) -> tuple[jax.Array, None]:
            model = eqx.combine(_cast_to_compute(params, self.dtype), static)
            logits = jax.vmap(model)(batch["x"].astype(self.dtype))
            return _xent(logits, batch["y"]), None
        return loss_fn

    def objective(self) -> tuple[Callable[[Any], tuple[jax.Array, Any]], Any]:
        params, static = eqx.partition(self.model, eqx.is_inexact_array)
        return self._loss(static, self.batch), params

    def grads(self, method: str, factor: float, config: AdaLossConfig | None = None,
              scale: float = STATIC_SCALE, backoff: int = 0) -> Grads:
        params, static = eqx.partition(self.model, eqx.is_inexact_array)
        vg = _method_value_and_grad(method, factor, config, jax.value_and_grad, scale, backoff)

        @jax.jit
        def step(params: Any, batch: dict[str, jax.Array]) -> Any:
            return vg(self._loss(static, batch))(params)

        _, g, rep = step(params, self.batch)
        return Grads(_names(g), rep)

    def train(self, steps: int, factor: float, config: AdaLossConfig | None = None,
              dynamic: bool = False) -> dict[str, Any]:
        tx = _optimizer(dynamic)
        model = self.model
        opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def train_step(model: Any, opt_state: Any, ls: Any, batch: dict[str, jax.Array]) -> Any:
            params, static = eqx.partition(model, eqx.is_inexact_array)
            loss_fn = self._loss(static, batch)
            if dynamic:
                (loss, _), grads, ls = _jmp_value_and_grad(lambda p: _times(loss_fn(p), factor), ls)(params)
            else:
                (loss, _), grads = jax_adaloss.value_and_grad(
                    lambda p: _times(loss_fn(p), factor), has_aux=True, config=config)(
                    params, adaloss_state=opt_state)
            updates, opt_state = tx.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state, ls, loss

        losses, counts = [], []
        ls = _initial_loss_scale()
        for _ in range(steps):
            model, opt_state, ls, loss = train_step(model, opt_state, ls, self.batch)
            losses.append(float(loss) / factor)
            counts.append(_skipped(opt_state, dynamic))
        return {"losses": losses, "skipped": counts[-1], "skip_flags": skip_flags(counts),
                "state_changed": [], "step": steps}


CASES: dict[str, Callable[[], JaxCase]] = {
    "linen-cnn": linen_cnn,
    "linen-transformer": linen_transformer,
    "nnx-bn-dropout": NnxCase,
    "equinox-mlp": EquinoxCase,
}
