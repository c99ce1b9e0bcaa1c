"""Which layers users train get per-layer scales: every weighted layer type of torch.nn, peft, Flax
(linen and nnx) and Equinox, built alone in a tiny model, classified by what adaloss does with it.

Each :class:`LayerType` is probed once (:func:`probe`) at loss ×1e-6 in fp16 (CPU autocast in
PyTorch, fp16 compute with fp32 parameters in JAX): a learnable elementwise factor in front of the
layer gives its input a gradient (so that a decision has something to scale), the loss is the mean
squared distance of its output to a fixed target. The row says:

- ``status``: ``per-layer`` (its weight·data matmuls or convolutions get their own decision),
  ``carried`` (no weighted op of its own: norms, lookups, PReLU; its gradients carry the scale of
  the cotangent it receives, decided by the layers around it), ``region`` (one scale for the
  whole layer, and a :class:`adaloss.report.AdaLossCoverageWarning` says so), ``error`` (refused
  with the error in ``detail``) or ``silent`` (a weighted layer with no decision and no word:
  the outcome this table exists to rule out);
- ``fan_in`` against a brute-force count (the input gradient of the same layer with every
  parameter and output cotangent 1) for the layers with one weight;
- the worst relative gradient error against fp32 of adaloss and of the global baseline people
  use instead (``torch.amp.GradScaler``; ``jmp.DynamicLossScale`` from 2^15), same weights and data.

``python benchmarks/coverage.py --json docs/coverage.json`` writes the table; :func:`page` makes
``docs/coverage.md`` from it; ``tests/test_coverage_table.py`` probes every type again and fails
on a silent row, a fan-in off its count, an error beyond the baseline's, or a status that changed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from adaloss_zoo.metrics import grad_error

FACTOR = 1e-6
_FACTOR = "1e-6"  # as the pages write it
STATUSES = ("per-layer", "carried", "region", "error", "silent")
# adaloss's worst error may exceed the baseline's by this much (fp16 rounding of the same
# forward, differently ordered in a backward of other scales) before a row fails
SLACK = (1.5, 2e-3)


@dataclasses.dataclass(frozen=True)
class LayerType:
    """One layer type: ``build() -> (module or params, input)``; ``weighted``: it has a
    weight·data matmul or convolution (a decision point)."""

    framework: str  # "torch" | "jax"
    name: str
    build: Callable[[], Any]
    weighted: bool = True
    fan_in: bool = False  # compare its one weight's fan-in with a brute-force count
    note: str = ""
    # parameters left out of the errors: an analytically zero gradient (a key bias, under
    # softmax's shift invariance), whose reference is rounding noise
    exclude: tuple[str, ...] = ()


def within_noise(ours: float, baseline: float) -> bool:
    """Whether adaloss's worst error is within fp16 noise of the baseline's (:data:`SLACK`)."""
    return ours <= SLACK[0] * baseline + SLACK[1]


# -- PyTorch --------------------------------------------------------------------------------------
def _torch_types() -> list[LayerType]:
    import torch
    from torch import nn

    def seq(c: int = 8, t: int = 6, b: int = 4) -> Any:
        return torch.randn(b, t, c)

    def img(c: int, *size: int) -> Any:
        return torch.randn(2, c, *size)

    def fused_lstm() -> Any:
        return nn.LSTM(8, 16, num_layers=2, batch_first=True), seq()

    def lora() -> Any:
        import peft
        base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False)
        return peft.get_peft_model(base, cfg), seq()

    def weight_norm() -> Any:
        return nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), seq()

    def spectral_norm() -> Any:
        return nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16)), seq()

    def encoder() -> Any:
        return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), seq()

    def decoder() -> Any:
        layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        memory = torch.randn(4, 6, 8)
        return _WithMemory(layer, memory), seq()

    types = [
        LayerType("torch", "nn.Linear", lambda: (nn.Linear(8, 16), seq()), fan_in=True),
        LayerType("torch", "nn.Bilinear", lambda: (_Bilinear(), seq())),
        LayerType("torch", "nn.Conv1d(stride=2)", lambda: (nn.Conv1d(4, 8, 3, stride=2), img(4, 17)),
                  fan_in=True),
        LayerType("torch", "nn.Conv2d(groups=2, dilation=2)",
                  lambda: (nn.Conv2d(4, 8, 3, dilation=2, groups=2), img(4, 12, 12)), fan_in=True),
        LayerType("torch", "nn.Conv2d(depthwise)", lambda: (nn.Conv2d(4, 4, 3, groups=4), img(4, 10, 10)),
                  fan_in=True),
        LayerType("torch", "nn.Conv3d", lambda: (nn.Conv3d(2, 4, 3), img(2, 6, 6, 6)), fan_in=True),
        LayerType("torch", "nn.ConvTranspose1d(stride=2)",
                  lambda: (nn.ConvTranspose1d(4, 8, 4, stride=2, padding=1), img(4, 9)), fan_in=True),
        LayerType("torch", "nn.ConvTranspose2d(groups=2, dilation=2)",
                  lambda: (nn.ConvTranspose2d(4, 6, 3, stride=2, dilation=2, groups=2), img(4, 6, 6)),
                  fan_in=True),
        LayerType("torch", "nn.ConvTranspose3d",
                  lambda: (nn.ConvTranspose3d(2, 4, 2, stride=2), img(2, 3, 3, 3)), fan_in=True),
        LayerType("torch", "nn.Embedding", lambda: (nn.Embedding(20, 8), torch.randint(0, 20, (4, 6))),
                  weighted=False),
        LayerType("torch", "nn.EmbeddingBag", lambda: (nn.EmbeddingBag(20, 8), torch.randint(0, 20, (4, 6))),
                  weighted=False),
        LayerType("torch", "nn.RNN (decomposed)", lambda: (nn.RNN(8, 16, batch_first=True), seq())),
        LayerType("torch", "nn.GRU (decomposed)", lambda: (nn.GRU(8, 16, batch_first=True), seq())),
        LayerType("torch", "nn.LSTM (decomposed)",
                  lambda: (_Unfused(nn.LSTM(8, 16, batch_first=True)), seq()),
                  note="oneDNN off (torch.backends.mkldnn.flags(enabled=False)): one matmul per step"),
        LayerType("torch", "nn.LSTM (fused, oneDNN)", fused_lstm,
                  note="bf16 (the CPU's fused RNN) with fp16's limits; cuDNN's and MIOpen's nodes "
                       "take the same rule"),
        LayerType("torch", "nn.MultiheadAttention",
                  lambda: (_MHA(nn.MultiheadAttention(8, 2, batch_first=True)), seq())),
        LayerType("torch", "nn.TransformerEncoderLayer", encoder),
        LayerType("torch", "nn.TransformerDecoderLayer", decoder),
        LayerType("torch", "nn.LayerNorm", lambda: (nn.LayerNorm(8), seq()), weighted=False),
        LayerType("torch", "nn.RMSNorm", lambda: (nn.RMSNorm(8), seq()), weighted=False),
        LayerType("torch", "nn.GroupNorm", lambda: (nn.GroupNorm(2, 4), img(4, 5, 5)), weighted=False),
        LayerType("torch", "nn.BatchNorm2d", lambda: (nn.BatchNorm2d(4), img(4, 5, 5)), weighted=False),
        LayerType("torch", "nn.PReLU", lambda: (nn.PReLU(8), img(8, 5)), weighted=False),
        LayerType("torch", "parametrizations.weight_norm(nn.Linear)", weight_norm),
        LayerType("torch", "parametrizations.spectral_norm(nn.Linear)", spectral_norm),
        LayerType("torch", "peft LoRA (frozen base)", lora),
    ]
    return types


def _torch_classes() -> dict[str, type]:
    import torch
    from torch import nn

    class Bilinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bil = nn.Bilinear(8, 8, 12)

        def forward(self, x: Any) -> Any:
            return self.bil(x, torch.tanh(x))

    class Unfused(nn.Module):
        def __init__(self, rnn: nn.Module) -> None:
            super().__init__()
            self.rnn = rnn

        def forward(self, x: Any) -> Any:
            with torch.backends.mkldnn.flags(enabled=False):
                return self.rnn(x)[0]

    class MHA(nn.Module):
        def __init__(self, mha: nn.Module) -> None:
            super().__init__()
            self.mha = mha

        def forward(self, x: Any) -> Any:
            return self.mha(x, x, x, need_weights=False)[0]

    class WithMemory(nn.Module):
        def __init__(self, layer: nn.Module, memory: Any) -> None:
            super().__init__()
            self.layer = layer
            self.register_buffer("memory", memory)

        def forward(self, x: Any) -> Any:
            return self.layer(x, self.memory)

    return {"Bilinear": Bilinear, "Unfused": Unfused, "MHA": MHA, "WithMemory": WithMemory}


def _Bilinear() -> Any:  # noqa: N802 (module classes built where torch is imported)
    return _torch_classes()["Bilinear"]()


def _Unfused(rnn: Any) -> Any:  # noqa: N802
    return _torch_classes()["Unfused"](rnn)


def _MHA(mha: Any) -> Any:  # noqa: N802
    return _torch_classes()["MHA"](mha)


def _WithMemory(layer: Any, memory: Any) -> Any:  # noqa: N802
    return _torch_classes()["WithMemory"](layer, memory)


def _torch_model(layer: Any, x: Any) -> Any:
    """``layer`` behind a learnable elementwise factor (for float inputs), its output's first
    tensor the model's output."""
    import torch
    from torch import nn

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer
            self.pre = nn.Parameter(torch.ones(x.shape[1:])) if x.is_floating_point() else None

        def forward(self, x: Any) -> Any:
            out = self.layer(x * self.pre if self.pre is not None else x)
            return out[0] if isinstance(out, tuple) else out

    return Probe()


def _torch_loss(model: Any, x: Any, target: Any, factor: float, dtype: Any) -> Any:
    import torch
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        out = model(x)
    return factor * torch.mean(torch.square(out.float() - target))


def _torch_grads(model: Any, factor: float) -> dict[str, np.ndarray]:
    return {n: p.grad.double().numpy() / factor for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def probe_torch(t: LayerType, seed: int = 0) -> dict[str, Any]:
    """The row of a PyTorch layer type (see the module's docstring)."""
    import torch

    import torch_bridge
    from adaloss import AdaLossConfig
    from adaloss.report import AdaLossCoverageWarning, weight_of
    torch.manual_seed(seed)
    layer, x = t.build()
    model = _torch_model(layer, x)
    with torch.no_grad():
        target = model(x).float() + torch.randn_like(model(x).float())
    fused = "fused" in t.name
    dtype = torch.bfloat16 if fused else torch.float16
    config = AdaLossConfig(grad_format="bfloat16", u_min=2.0**-14, u_max=65504.0) if fused else None
    ref_model = copy.deepcopy(model).float()
    _torch_loss(ref_model, x, target, FACTOR, None).backward()
    ref = _torch_grads(ref_model, FACTOR)
    row: dict[str, Any] = {"framework": "torch", "layer": t.name, "note": t.note}
    # the baseline
    base = copy.deepcopy(model)
    gs = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(base.parameters(), lr=0.0)
    for _ in range(32):
        base.zero_grad()
        gs.scale(_torch_loss(base, x, target, FACTOR, dtype)).backward()
        gs.unscale_(opt)
        got = _torch_grads(base, FACTOR)
        gs.step(opt)
        gs.update()
        if all(np.isfinite(g).all() for g in got.values()):
            break
    row["baseline"] = "torch.amp.GradScaler"
    exclude = ("pre", *t.exclude)
    row["baseline_error"] = grad_error(got, ref, exclude).worst
    # adaloss
    ours = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            scaler = torch_bridge.AdaLossScaler(ours, config)
            scaler.scale(_torch_loss(ours, x, target, FACTOR, dtype)).backward()
            scaler.unscale_(torch.optim.SGD(ours.parameters(), lr=0.0))
        except Exception as e:  # noqa: BLE001 (the row records the refusal)
            return {**row, "status": "error", "detail": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                    "error": None, "fan_in": None, "counted_fan_in": None}
    warned = [str(w.message) for w in said if issubclass(w.category, AdaLossCoverageWarning)]
    reports = scaler.layer_reports()
    decided = {weight_of(n) for n, r in reports.items() if not n.startswith(("cast:", "region:"))}
    params = {n for n, p in ours.named_parameters() if p.requires_grad and n != "pre"}
    row["error"] = grad_error(_torch_grads(ours, FACTOR), ref, exclude).worst
    row.update(_status(t, sorted(decided & params), warned))
    row["fan_in"] = row["counted_fan_in"] = None
    if t.fan_in:
        (name,) = [n for n in decided & params if n.endswith("weight")]
        row["fan_in"] = int(reports[name].fan_in)
        row["counted_fan_in"] = _torch_count(layer, x)
    return row


def _torch_count(layer: Any, x: Any) -> int:
    """The most terms an input-gradient entry of ``layer`` sums: its input gradient with every
    parameter and output cotangent 1."""
    import torch
    ones = copy.deepcopy(layer).double()
    with torch.no_grad():
        for p in ones.parameters():
            p.fill_(1.0)
    x1 = torch.ones_like(x, dtype=torch.float64, requires_grad=True)
    out = ones(x1)
    (dx,) = torch.autograd.grad(out, x1, torch.ones_like(out))
    return int(dx.max())


def _status(t: LayerType, decided: list[str], warned: list[str]) -> dict[str, Any]:
    if t.weighted and decided:
        return {"status": "per-layer", "detail": f"{len(decided)} weight(s) decided: {', '.join(decided)}"}
    if warned:
        return {"status": "region", "detail": warned[0]}
    if not t.weighted:
        return {"status": "carried", "detail": "no weighted op: its gradients carry the scale it receives"}
    return {"status": "silent", "detail": "a weighted layer with no decision and no warning"}


# -- JAX ------------------------------------------------------------------------------------------
def _jax_types() -> list[LayerType]:
    import equinox as eqx
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    k = jax.random.key(0)
    seq = jax.random.normal(jax.random.key(1), (4, 6, 8))
    img = jax.random.normal(jax.random.key(2), (2, 10, 10, 4))
    ids = jax.random.randint(jax.random.key(3), (4, 6), 0, 20)

    def linen(module: Any, x: Any, dtype: Any = None) -> Any:
        return ("linen", module, x, module.dtype if dtype is None else dtype)

    def rnn(cell: Any) -> Any:
        return linen(nn.RNN(cell), seq, cell.dtype)

    def nnx_mod(make: Callable[[Any], Any], x: Any) -> Any:
        module = make(nnx.Rngs(0))
        return ("nnx", module, x, module.dtype)

    def eqx_mod(module: Any, x: Any, dtype: Any) -> Any:
        return ("equinox", module, x, dtype)

    def eqx_lstm(d: Any) -> Any:
        return ("equinox-scan", eqx.nn.LSTMCell(8, 16, key=k), seq, d)

    def attention(q: Any, kk: Any, v: Any, is_causal: bool = False, **kw: Any) -> Any:
        # flax's einsum attention: XLA:CPU cannot lower the fused one's fp16 dot algorithm
        if is_causal:
            raise ValueError("the probes' attention is not causal")
        return nn.dot_product_attention(q, kk, v, **kw)

    class Branches(nn.Module):
        """A Dense layer in each branch of flax's lifted ``nn.cond`` (a ``lax.cond`` on data), as
        flax's docs write it: both built in ``setup``, both run at init."""

        dtype: Any

        def setup(self) -> None:
            self.first, self.second = nn.Dense(16, dtype=self.dtype), nn.Dense(16, dtype=self.dtype)

        def __call__(self, x: Any) -> Any:
            def first(m: Any, x: Any) -> Any:
                return jnp.tanh(m.first(x))

            def second(m: Any, x: Any) -> Any:
                return m.second(x)
            if self.is_mutable_collection("params"):
                first(self, x), second(self, x)
            return nn.cond(jnp.mean(x) > 0, first, second, self, x)

    return [
        LayerType("jax", "linen.Dense", lambda d: linen(nn.Dense(16, dtype=d), seq), fan_in=True),
        LayerType("jax", "linen.DenseGeneral", lambda d: linen(nn.DenseGeneral((2, 8), dtype=d), seq)),
        LayerType("jax", "linen.Einsum", lambda d: linen(nn.Einsum((8, 16), "btc,cd->btd", dtype=d), seq)),
        LayerType("jax", "linen.Conv(strides=2, groups=2)",
                  lambda d: linen(nn.Conv(8, (3, 3), strides=2, feature_group_count=2, dtype=d), img),
                  fan_in=True),
        LayerType("jax", "linen.ConvTranspose(strides=2)",
                  lambda d: linen(nn.ConvTranspose(6, (3, 3), strides=(2, 2), dtype=d), img), fan_in=True),
        LayerType("jax", "linen.Embed", lambda d: linen(nn.Embed(20, 8, dtype=d), ids), weighted=False),
        LayerType("jax", "linen.Dense in nn.cond branches", lambda d: linen(Branches(dtype=d), seq)),
        LayerType("jax", "linen.LSTMCell in nn.RNN", lambda d: rnn(nn.LSTMCell(16, dtype=d))),
        LayerType("jax", "linen.GRUCell in nn.RNN", lambda d: rnn(nn.GRUCell(16, dtype=d))),
        LayerType("jax", "linen.MultiHeadDotProductAttention",
                  lambda d: linen(nn.MultiHeadDotProductAttention(2, dtype=d, attention_fn=attention), seq),
                  exclude=("key/bias",)),
        LayerType("jax", "linen.LayerNorm", lambda d: linen(nn.LayerNorm(dtype=d), seq), weighted=False),
        LayerType("jax", "linen.RMSNorm", lambda d: linen(nn.RMSNorm(dtype=d), seq), weighted=False),
        LayerType("jax", "linen.BatchNorm",
                  lambda d: linen(nn.BatchNorm(use_running_average=True, dtype=d), img), weighted=False),
        LayerType("jax", "linen.GroupNorm", lambda d: linen(nn.GroupNorm(2, dtype=d), img), weighted=False),
        LayerType("jax", "nnx.Linear", lambda d: nnx_mod(lambda r: nnx.Linear(8, 16, dtype=d, rngs=r), seq),
                  fan_in=True),
        LayerType("jax", "nnx.Conv",
                  lambda d: nnx_mod(lambda r: nnx.Conv(4, 8, (3, 3), dtype=d, rngs=r), img), fan_in=True),
        LayerType("jax", "nnx.Embed", lambda d: nnx_mod(lambda r: nnx.Embed(20, 8, dtype=d, rngs=r), ids),
                  weighted=False),
        LayerType("jax", "nnx.MultiHeadAttention", lambda d: nnx_mod(
            lambda r: nnx.MultiHeadAttention(2, 8, dtype=d, decode=False, attention_fn=attention, rngs=r),
            seq),
                  exclude=("key/bias",)),
        LayerType("jax", "nnx.LayerNorm", lambda d: nnx_mod(lambda r: nnx.LayerNorm(8, dtype=d, rngs=r), seq),
                  weighted=False),
        LayerType("jax", "equinox.nn.Linear", lambda d: eqx_mod(eqx.nn.Linear(8, 16, key=k), seq, d),
                  fan_in=True),
        LayerType("jax", "equinox.nn.Conv2d", lambda d: eqx_mod(eqx.nn.Conv2d(4, 8, 3, key=k),
                                                                jnp.moveaxis(img, -1, 1), d), fan_in=True),
        LayerType("jax", "equinox.nn.LSTMCell (lax.scan)", eqx_lstm),
    ]


def _jax_forward(spec: Any) -> tuple[Any, Callable[[Any, Any], Any], Callable[[Any, Any], Any], Any]:
    """(parameters, ``apply(params, x)`` computing in the spec's 16-bit dtype, the same computing
    in fp32, input) of a probe's spec; the module is built and initialised once."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from flax import nnx
    kind, module, x, dtype = spec
    f32 = jnp.float32
    if kind == "linen":
        variables = jax.jit(module.init)(jax.random.key(0), x)
        params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
        wide = (module.clone(cell=module.cell.clone(dtype=f32)) if hasattr(module, "cell")
                else module.clone(dtype=f32))

        def linen_apply(m: Any) -> Callable[[Any, Any], Any]:
            return lambda p, x: m.apply({"params": p, **rest}, x)
        return params, linen_apply(module), linen_apply(wide), x
    if kind == "nnx":
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        wide = nnx.clone(module)
        for _, sub in nnx.iter_modules(wide):
            if getattr(sub, "dtype", None) is not None:
                sub.dtype = f32
        wide_def = nnx.split(wide, nnx.Param, ...)[0]

        def nnx_apply(g: Any) -> Callable[[Any, Any], Any]:
            return lambda p, x: nnx.merge(g, p, rest)(x)
        return params, nnx_apply(graphdef), nnx_apply(wide_def), x
    params, static = eqx.partition(module, eqx.is_inexact_array)

    def eqx_apply(dtype: Any) -> Callable[[Any, Any], Any]:
        def cast(p: Any) -> Any:
            return jax.tree.map(lambda a: a.astype(dtype), p)

        if kind == "equinox-scan":  # the cell over time in lax.scan
            def apply(p: Any, x: Any) -> Any:
                cell = eqx.combine(cast(p), static)
                h0 = (jnp.zeros((x.shape[0], cell.hidden_size), dtype),) * 2

                def step(h: Any, xt: Any) -> Any:
                    h = jax.vmap(cell)(xt, h)
                    return h, h[0]
                return jnp.moveaxis(jax.lax.scan(step, h0, jnp.moveaxis(x.astype(dtype), 1, 0))[1], 0, 1)
            return apply

        def apply(p: Any, x: Any) -> Any:
            layer = eqx.combine(cast(p), static)
            fn = layer
            for _ in range(x.ndim - (3 if isinstance(layer, eqx.nn.Conv) else 1)):
                fn = jax.vmap(fn)
            return fn(x.astype(dtype))
        return apply
    return params, eqx_apply(dtype), eqx_apply(f32), x


def probe_jax(t: LayerType, seed: int = 0) -> dict[str, Any]:
    """The row of a JAX layer type (see the module's docstring)."""
    import jax
    import jax.numpy as jnp
    import jmp

    import jax_adaloss
    from adaloss.report import AdaLossCoverageWarning, weight_of
    params, apply, apply_f32, x = _jax_forward(t.build(jnp.float16))
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    params = {"layer": params, "pre": jnp.ones(x.shape[1:], jnp.float32)} if floating else {"layer": params}

    def loss(p: Any, x: Any, apply: Callable[[Any, Any], Any] = apply) -> Any:
        h = x * p["pre"] if "pre" in p else x
        out = apply(p["layer"], h)
        out = out[0] if isinstance(out, tuple) else out
        return FACTOR * jnp.mean(jnp.square(out.astype(jnp.float32) - 1.0))

    @jax.jit
    def baseline(p: Any, x: Any, scale: jmp.DynamicLossScale) -> Any:
        """fp32's gradients (the same parameters computed in fp32), and jmp's documented step."""
        ref = jax.grad(lambda p: loss(p, x, apply_f32))(p)
        grads = scale.unscale(jax.grad(lambda p: scale.scale(loss(p, x)))(p))
        finite = jmp.all_finite(grads)
        return ref, grads, finite, scale.adjust(finite)

    scale = jmp.DynamicLossScale(jnp.float32(2.0**15))
    for _ in range(32):
        ref, grads, finite, scale = baseline(params, x, scale)
        if bool(finite):
            break
    ref = _leaves(_over(ref))
    row: dict[str, Any] = {"framework": "jax", "layer": t.name, "note": t.note}
    row["baseline"] = "jmp.DynamicLossScale(2^15)"
    exclude = ("pre", *t.exclude)
    row["baseline_error"] = grad_error(_leaves(_over(grads)), ref, exclude).worst
    vg = jax_adaloss.value_and_grad(loss, return_report=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            (_, grads), rep = jax.jit(lambda p, x: vg(p, x, adaloss_state=None))(params, x)
        except Exception as e:  # noqa: BLE001 (the row records the refusal)
            return {**row, "status": "error", "detail": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                    "error": None, "fan_in": None, "counted_fan_in": None}
    warned = [str(w.message) for w in said if issubclass(w.category, AdaLossCoverageWarning)]
    row["error"] = grad_error(_leaves(_over(jax_adaloss.unscale_tree(grads))), ref, exclude).worst
    decided = sorted({weight_of(n) for n in rep.layers if not n.startswith("cast:")} - {"pre"})
    row.update(_status(t, decided, warned))
    row["fan_in"] = row["counted_fan_in"] = None
    if t.fan_in:
        (name,) = decided
        row["fan_in"] = int(rep.layers[name].fan_in)
        row["counted_fan_in"] = _jax_count(apply, params["layer"], x)
    return row


def _over(grads: Any) -> Any:
    import jax
    return jax.tree.map(lambda g: g / FACTOR, grads)


def _jax_count(apply: Callable[[Any, Any], Any], params: Any, x: Any) -> int:
    import jax
    import jax.numpy as jnp
    @jax.jit
    def count(params: Any, x: Any) -> Any:
        ones = jax.tree.map(jnp.ones_like, params)
        out, vjp = jax.vjp(lambda x: apply(ones, x), jnp.ones_like(x, jnp.float32))
        (dx,) = vjp(jnp.ones_like(out))
        return jnp.max(dx)
    return int(count(params, x))


def _leaves(tree: Any) -> dict[str, np.ndarray]:
    import jax
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = np.asarray(leaf, np.float64)
    return out


# -- the table ------------------------------------------------------------------------------------
def layer_types(framework: str | None = None) -> list[LayerType]:
    """Every probed type (of one framework)."""
    types = []
    if framework in (None, "torch"):
        types += _torch_types()
    if framework in (None, "jax"):
        types += _jax_types()
    return types


def probe(t: LayerType) -> dict[str, Any]:
    """The row of one type."""
    return probe_torch(t) if t.framework == "torch" else probe_jax(t)


def problems(row: dict[str, Any]) -> list[str]:
    """What is wrong with a row: silent, a fan-in off its count, an error beyond the baseline's."""
    out = []
    if row["status"] == "silent":
        out.append("silent: a weighted layer with no decision and no warning")
    if row["fan_in"] != row["counted_fan_in"]:
        out.append(f"fan-in {row['fan_in']} != the brute-force count {row['counted_fan_in']}")
    if row["error"] is not None and not within_noise(row["error"], row["baseline_error"]):
        out.append(f"error {row['error']:.3g} beyond {row['baseline']}'s {row['baseline_error']:.3g}")
    if row["error"] is not None and not math.isfinite(row["error"]):
        out.append("non-finite gradients")
    return out


def page(data: dict[str, Any]) -> str:
    """The generated body of ``docs/coverage.md`` from ``docs/coverage.json``."""
    out = [f"Generated from `docs/coverage.json`, written by `{data['command']}` on {data['date']} "
           f"({data['versions']}). Loss ×{_FACTOR}, fp16; *error*: the worst relative error of a "
           "parameter's gradient against fp32 (same weights and data), adaloss's and the global "
           "baseline's. *Fan-in*: the layer's, against a brute-force count.", ""]
    for framework, title in (("torch", "PyTorch"), ("jax", "JAX")):
        rows = [r for r in data["rows"] if r["framework"] == framework]
        if not rows:
            continue
        out += [f"## {title}", "",
                "| layer | status | fan-in (count) | error | baseline's error | what happens |",
                "|---|---|---|---|---|---|"]
        for r in rows:
            fan = "–" if r["fan_in"] is None else f"{r['fan_in']} ({r['counted_fan_in']})"
            err = "–" if r["error"] is None else f"{r['error']:.2g}"
            said = r["detail"] + (f" ({r['note']})" if r["note"] else "")
            out.append(f"| `{r['layer']}` | {r['status']} | {fan} | {err} | {r['baseline_error']:.2g} "
                       f"| {said.replace('|', '/')} |")
        out.append("")
    counts = {s: sum(r["status"] == s for r in data["rows"]) for s in STATUSES}
    out.append("Rows by status: " + ", ".join(f"{s} {n}" for s, n in counts.items()) + ".")
    return "\n".join(out) + "\n"


def line(data: dict[str, Any]) -> str:
    """One sentence for the README: the types probed, by status."""
    rows = data["rows"]
    n = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    return (f"{len(rows)} layer types of torch.nn, peft, Flax and Equinox probed at loss ×{_FACTOR}: "
            f"{n['per-layer']} scaled per layer, {n['carried']} without a weighted op (their gradients "
            f"carry the scale they receive), {n['region']} one warned region, {n['error']} refused, "
            f"{n['silent']} silent.")
