"""``AdaLossScaler``: adaptive per-layer loss scaling with ``torch.amp.GradScaler``'s interface.

A loop that uses ``GradScaler`` switches by replacing the constructor::

    scaler = torch_bridge.AdaLossScaler(model, config)   # instead of GradScaler()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()        # or scaler.backward(loss)
    scaler.unscale_(optimizer)           # optional, e.g. before clipping
    scaler.step(optimizer)               # skipped when a gradient is not finite
    scaler.update()

or, Apex style, ``with scaler.scale_loss(loss, optimizer) as scaled: scaled.backward()``
followed by ``optimizer.step()``.

``scale(loss)`` plans the scales of the autograd graph below ``loss`` (see
:mod:`torch_bridge.graph`) and hooks it (:mod:`torch_bridge.hooks`); the
backward then gives every layer its own scale and leaves each parameter's
``.grad`` multiplied by the scale in :meth:`AdaLossScaler.grad_scales`.
``unscale_``/``step`` divide each gradient by its own scale and check all of
them for inf/NaN with GradScaler's kernel; ``step`` reads that one flag (the
only host synchronisation) and skips the optimizer step when it is set.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import sys
import uuid
import warnings
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from adaloss import decisions, skips, solver
from adaloss.config import AdaLossConfig
from adaloss.report import Coverage, LayerReport, warn_coverage, weight_of
from torch_bridge import regions
from torch_bridge._xp import xp
from torch_bridge.fused import BACKENDS, FusedMath, FusionSchedule
from torch_bridge.graph import ScalePlan, parameter_names
from torch_bridge.hooks import (
    COMPILED_AUTOGRAD,
    THROUGH_RECORDED,
    BackwardRecord,
    ScaledBackward,
    compiled_autograd,
    rescale,
    u_max,
)
from torch_bridge.regions import RegionScales, found_total
from torch_bridge.sharded import (
    Fp16Routes,
    agree_found_inf,
    fsdp2_modules,
    local_grad,
    own_values,
    refuse_fsdp1,
    unsharded_names,
)
from torch_bridge.skip_ledger import SkipLedger

_F32 = torch.float32

#: ``fuse_decisions="auto"``: backwards in a row that meet their decisions with the same shapes
#: before the decisions run compiled (a short run, a test, a run whose shapes vary: never)
STEADY_AFTER = 20


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state() -> dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf": {}}


def _check_float8_layers(model: torch.nn.Module, config: AdaLossConfig) -> None:
    """The fp8 layers of ``model`` (:mod:`torch_bridge.float8`) and ``config`` agree: an
    ``operand_format`` is what those layers' forward does, nothing the scaler can do alone."""
    from torch_bridge.float8 import Float8Linear
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    if config.operand_format is None and not layers:
        return
    if not layers:
        raise ValueError(
            f"AdaLossConfig.operand_format={config.operand_format!r} (fp8 layer inputs and weights): "
            "the scaler sees a module's graph after its forward has run, so the forward must be "
            "converted first: torch_bridge.convert_to_float8_training(model, config), then "
            "AdaLossScaler(model, config).")
    for name, m in layers.items():
        if (m.config.grad_format, m.config.operand_format) != (config.grad_format, config.operand_format):
            raise ValueError(
                f"the fp8 layer {name} was converted with grad_format={m.config.grad_format!r}, "
                f"operand_format={m.config.operand_format!r}, but the scaler's config has "
                f"grad_format={config.grad_format!r}, operand_format={config.operand_format!r}: "
                "give both the same AdaLossConfig.")


_SAID_DEVICE: set[str] = set()


def _say_device_unused(device: torch.device, model: torch.nn.Module) -> None:
    """``device=`` is GradScaler's; here each scale lives on its gradient's device: said once."""
    on = sorted({p.device.type for p in model.parameters()})
    text = (f"AdaLossScaler(device={str(device)!r}) is accepted for torch.amp.GradScaler's "
            "signature and not used: each scale lives on the device of the gradient it scales (this "
            f"model's parameters are on {', '.join(on)}).")
    if device.type not in on:
        text += " Move the model to that device before training."
    if text not in _SAID_DEVICE:
        _SAID_DEVICE.add(text)
        warnings.warn(text, UserWarning, stacklevel=3)


class AdaLossScaler:
    """Adaptive loss scaling for an unmodified ``nn.Module`` (method: Zhao et al., 2019).

    Args:
      model: the module whose parameters are trained; layers are named after
        their weight's parameter name.
      config: an :class:`~adaloss.config.AdaLossConfig` (default ``AdaLossConfig()``),
        the same object ``jax_adaloss`` takes.
      device: ``torch.amp.GradScaler``'s first argument, accepted by keyword and not used
        (said once): each scale lives on the device of the gradient it scales.
      enabled: ``False`` makes every method a pass-through (``step`` just calls
        ``optimizer.step()``), as with ``GradScaler(enabled=False)``.
      capture: keep each layer's incoming cotangent of the last backward
        (:meth:`captured_cotangents`), for underflow measurements.
      host_math: for CPU gradients, compute the scalar decisions on NumPy fp32
        scalars (same arithmetic, ~8x cheaper than 0-d tensors); accelerator
        gradients always use device tensors, and so does ``fuse_decisions``.
      fuse_decisions: run each decision (the statistics of its cotangent and activation,
        its scalar math, the rescaled cotangent) as one compiled call, and the weights'
        statistics as one more per backward (:mod:`torch_bridge.kernels`,
        :class:`torch_bridge.fused.FusedMath`), on any device, CPU gradients too
        (``host_math`` then does not apply). ``"auto"`` (default): with inductor, once
        ``torch_bridge.scaler.STEADY_AFTER`` (20) backwards in a row met their decisions with
        the same shapes (op by op until then, and again while shapes change; a run whose
        shapes vary every step never compiles). ``True`` or ``"inductor"``: from the first backward;
        ``"eager"``: the traced graphs op by op; or a ``FusedMath`` of your own; ``False``: op
        by op always. A decision compiles once per shape of its tensors (seconds each on a
        CPU); past ``FusedMath.max_shapes`` shapes it warns and runs op by op; where inductor
        cannot compile (no C++ compiler, an unsupported device) it warns once and runs op by
        op. Not fused: the decisions of an fp8 ``grad_format``, scalar factors and first
        layers (their scalar math only) and tensor subclasses.
      unscale_in_backward: divide each parameter's gradient by its scale as autograd
        delivers it (before it is accumulated into ``.grad``), so that ``.grad`` holds the
        true gradient (scale 1; ``unscale_`` then only checks it). Data parallelism needs
        this: ``DistributedDataParallel`` all-reduces each gradient bucket as soon as it is
        ready, and ranks that chose different scales would average incompatible values.
        ``None`` (default): on when ``torch.distributed`` is initialized with more than one
        rank, and always for a ``fully_shard`` (FSDP2) model (:mod:`torch_bridge.sharded`).
        Exact for power-of-two scales (the default), as unscaling after the backward.
      init_scale, growth_factor, backoff_factor, growth_interval: ``torch.amp.GradScaler``'s,
        for the scales adaloss keeps GradScaler's way (``torch_bridge.regions``): the one
        scale of a backward that cannot carry per-layer scales (``torch.autograd.grad`` on a
        scaled loss, ``create_graph=True``: a gradient penalty), which :meth:`get_scale` returns
        from then on, and each opaque region's. Per-layer backwards decide their own scales
        (``config.init_scale`` multiplies their loss).
      warn_after_skips: after this many skipped steps in a row (iterations whose gradients held
        an inf or NaN), warn once per such run with the cause (:mod:`adaloss.skips`:
        a non-finite loss, or the first layer whose backward made the inf/NaN, by name), read
        from the device only on skipped steps; and once when more than a fifth of the last 100
        steps skipped though never that many in a row (:class:`adaloss.skips.SkipRate`).
        ``None``: never warn (:attr:`last_skip` and :attr:`skip_causes` still count them).

    Pickling and ``copy.deepcopy`` work at any point of training, as for ``GradScaler``: the
    copy refers to the same model (it does not carry one), with the state and counters as they
    were, including the scales of gradients not yet unscaled.
    """

    def __init__(self, model: torch.nn.Module, config: AdaLossConfig | None = None, *,
                 device: str | torch.device | None = None, enabled: bool = True,
                 capture: bool = False, host_math: bool = True,
                 unscale_in_backward: bool | None = None,
                 fuse_decisions: bool | str | FusedMath = "auto",
                 warn_after_skips: int | None = skips.WARN_AFTER,
                 init_scale: float = regions.INIT_SCALE, growth_factor: float = regions.GROWTH_FACTOR,
                 backoff_factor: float = regions.BACKOFF_FACTOR,
                 growth_interval: int = regions.GROWTH_INTERVAL) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"AdaLossScaler needs the nn.Module being trained, got {type(model).__name__}")
        if next(model.parameters(), None) is None:
            raise ValueError(
                f"AdaLossScaler: the module {type(model).__name__} has no parameters, so no layer of a "
                "backward can be named or scaled. Pass the module whose parameters the optimizer trains "
                "(several models: AdaLossScaler(torch.nn.ModuleList([model_a, model_b]))).")
        # skipped steps: counted, diagnosed, said (warn_after_skips checked there)
        self._skips = SkipLedger(warn_after_skips)
        refuse_fsdp1(model)
        #: FSDP2: gradients are unscaled as autograd delivers them, the inf/NaN check all-reduced
        self._sharded = bool(fsdp2_modules(model))
        # FSDP2 with fp16 copies: each gradient unscaled into FSDP2's fp32 one once accumulated
        self._routes = Fp16Routes()
        if self._sharded and unscale_in_backward is False:
            raise ValueError("unscale_in_backward=False with fully_shard (FSDP2): FSDP2 reduce-scatters "
                             "each gradient in its post-backward hook, so ranks' per-layer scales must "
                             "be removed before it; leave unscale_in_backward=None.")
        config = AdaLossConfig() if config is None else config
        if isinstance(config, (str, torch.device)):
            raise TypeError(f"AdaLossScaler(model, {config!r}): the second argument is the "
                            f"AdaLossConfig; GradScaler's device goes by keyword, device={config!r}")
        if not isinstance(config, AdaLossConfig):
            raise TypeError(f"config must be an AdaLossConfig, got {type(config).__name__}")
        if device is not None:
            _say_device_unused(torch.device(device), model)
        _check_float8_layers(model, config)
        self._model: torch.nn.Module | None = model
        self._token = _register(model)
        self._model_names: list[str] = []  # the model's parameter names, kept while unbound
        self._config = config
        self._enabled = bool(enabled)
        self.capture = bool(capture)
        self.host_math = bool(host_math)
        if not isinstance(fuse_decisions, (bool, str, FusedMath)):
            raise TypeError("fuse_decisions must be a bool, \"auto\", a backend name or a FusedMath, "
                            f"got {type(fuse_decisions).__name__}")
        if isinstance(fuse_decisions, str) and fuse_decisions not in ("auto", *BACKENDS):
            raise ValueError(f"fuse_decisions must be \"auto\" or a backend of {BACKENDS}, "
                             f"got {fuse_decisions!r}")
        # when the backwards run their decisions compiled
        self._schedule = FusionSchedule(
            fuse_decisions if isinstance(fuse_decisions, FusedMath)
            else None if fuse_decisions is False
            else FusedMath("inductor", steady_after=STEADY_AFTER) if fuse_decisions == "auto"
            else FusedMath("inductor" if fuse_decisions is True else fuse_decisions))
        self.unscale_in_backward = unscale_in_backward
        self._at_leaf = False  # this backward unscales at the leaves
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._iteration = 0  # update() calls
        self._model_scales: dict[str, torch.Tensor] = {}
        self._spreads: dict[str, Any] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # scale of p.grad now
        self._last: BackwardRecord | None = None
        self._plans: OrderedDict[Any, Any] = OrderedDict()  # graph structure -> plan
        self._per_optimizer: dict[int, dict[str, Any]] = defaultdict(_fresh_state)
        self._coverage: Coverage | None = None
        self._cast_sites: dict[str, str] = {}
        self._regions = RegionScales(regions.Growth(float(init_scale), float(growth_factor),
                                                    float(backoff_factor), growth_interval))
        # back-off exponent h and its count of finite steps (int32, on the loss's device)
        self._backoff: tuple[torch.Tensor, torch.Tensor] | None = None
        self._backoff_loaded = (0, 0)
        # per weight: lift exponent k (int32, on the loss's device), and the largest underflow
        # ratio the backwards since the last update() reported
        self._lift: dict[str, torch.Tensor] = {}
        self._ratio: dict[str, torch.Tensor] = {}
        self._warned_global = False
        # the scaled backwards prepared since update() (weak: the loss owns each)
        self._passes: list[weakref.ref[ScaledBackward]] = []

    # -- properties -------------------------------------------------------------------
    @property
    def config(self) -> AdaLossConfig:
        return self._config

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because a gradient was not finite."""
        return self._skips.steps

    @property
    def warn_after_skips(self) -> int | None:
        """Skipped steps in a row after which the scaler warns (``None``: never)."""
        return self._skips.warn_after

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step()`` (or ``scale_loss`` exit) skipped the optimizer step because
        a gradient was not finite. ``step`` read that flag already: no further host sync. An LR
        scheduler can follow it (``if not scaler.last_step_skipped: scheduler.step()``); trainers
        that detect a skip by ``optimizer.step`` not being called (Accelerate, HF ``Trainer``)
        see it too."""
        return self._skips.last

    @property
    def iteration(self) -> int:
        """``update()`` calls so far."""
        return self._iteration

    @property
    def consecutive_skipped(self) -> int:
        """Iterations in a row, up to the last ``update()``, whose step was skipped."""
        return self._skips.run

    @property
    def last_skip(self) -> skips.SkipDiagnosis | None:
        """Why the latest skipped iteration was skipped (:func:`adaloss.skips.diagnose`: a
        non-finite loss, the first layer whose backward made an inf/NaN, ...), or ``None``."""
        return self._skips.last_skip

    @property
    def skip_causes(self) -> dict[str, int]:
        """Skipped iterations per cause (:class:`adaloss.skips.SkipCause` values)."""
        return dict(self._skips.causes)

    # -- backward ---------------------------------------------------------------------
    @torch._disable_dynamo  # eager inside a compiled step (see torch_bridge.hooks)
    def scale(self, outputs: Any) -> Any:
        """Prepare the backward of ``outputs`` (a loss tensor, or a list/tuple of them).

        Returns ``outputs`` itself: call ``.backward()`` on it. The seed gradient is
        multiplied by ``config.init_scale``; every other scale is chosen per layer.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"scale() expects a tensor (or a list/tuple of tensors), got "
                            f"{type(outputs).__name__}")
        root = outputs.grad_fn
        if root is None:
            raise RuntimeError("scale(): the loss has no autograd graph (it does not require grad, "
                               "or it is a leaf); was the forward run under torch.no_grad()?")
        if compiled_autograd():
            raise RuntimeError(COMPILED_AUTOGRAD)
        prepared = root.metadata.get("adaloss")
        if prepared is not None and prepared() is not None:
            return outputs  # already prepared
        model = self._bound()
        names = self._names()
        plan = ScalePlan(root, names, cast_rule=self._config.cast_rule,
                         cache=self._plans, fp8=self._config.fp8,
                         grad_dtype=None if self._config.fp8 else getattr(torch, self._config.grad_format))
        if self._sharded:
            self._routes.hook(self._model)
        if plan.fresh:
            refuse_fsdp1(model)
            _warn_coverage(plan)
            _warn_foreign(plan, names, model)
        self._at_leaf = self._sharded or (_data_parallel() if self.unscale_in_backward is None
                                          else bool(self.unscale_in_backward))
        self._coverage = plan.coverage
        self._cast_sites = {p.name: p.what for p in sorted(plan.order, key=lambda p: p.rank)
                            if p.kind == "cast"}
        hidden: list[torch.Tensor] = []
        if plan.opaque:
            planned = {id(p) for p in plan.params if p is not None}
            hidden = [p for p in model.parameters() if id(p) not in planned]
        recompute = self._iteration % self._config.update_every == 0
        sb = ScaledBackward(plan, self._config, self._on_leaf, self._on_done, recompute=recompute,
                            model_scales=self._model_scales, spreads=self._spreads, capture=self.capture,
                            host_math=self.host_math, hidden=hidden, region_scale=self._regions.get,
                            every_leaf=self._at_leaf, fused=self._schedule.next(), loss=outputs.detach(),
                            **self.levels(outputs.device))
        recorded = {id(p.plan.root) for p in (ref() for ref in self._passes)
                    if p is not None and p.global_reason == "create_graph"}
        if recorded and any(id(n) in recorded for n in plan.nodes):
            sb.through_recorded = THROUGH_RECORDED  # a gradient penalty's second backward
        self._passes.append(weakref.ref(sb))
        # the loss tensor owns the hooks' state: it lives exactly as long as the graph is usable
        outputs._adaloss_backward = sb
        root.metadata["adaloss"] = weakref.ref(sb)
        return outputs

    def _bound(self) -> torch.nn.Module:
        """The model; raises, with the remedy, for a scaler unpickled where its model is not."""
        if self._model is None:
            raise RuntimeError(
                "This AdaLossScaler was unpickled in a process where the model it was built on does not "
                "exist: a scaler refers to its model, it does not carry a copy. Build one on the module "
                "being trained and give it this one's state: new = AdaLossScaler(model, config); "
                "new.load_state_dict(scaler.state_dict()).")
        return self._model

    def _names(self) -> dict[int, str]:
        """``id(parameter) -> name``; under FSDP2 the unsharded copies the forward used too,
        named after their shards."""
        names = parameter_names(self._model)
        return {**names, **unsharded_names(self._model)} if self._sharded else names

    def _backoff_state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, finite steps since h changed), created on the first backward's device."""
        if self._backoff is None:
            self._backoff = tuple(torch.full((), v, dtype=torch.int32, device=device)
                                  for v in self._backoff_loaded)  # type: ignore[assignment]
        return self._backoff  # type: ignore[return-value]

    def levels(self, device: torch.device | None = None) -> dict[str, Any]:
        """``{"backoff": 2^-h, "lift": {weight name: 2^k}}``: the fp32 factors the next backward
        applies (``device``: where the back-off state is created on first use; default: the
        model's)."""
        if device is None:
            device = next(self._bound().parameters()).device
        return {"backoff": solver.backoff_factor(self._backoff_state(device)[0], xp),
                "lift": {k: solver.lift_factor(v, xp) for k, v in self._lift.items()}}

    @property
    def lift(self) -> dict[str, int]:
        """Per weight, its layer's lift exponent ``k`` where not 0 (reads the device: for
        logging, not the training step).

        ``config.underflow_feedback``: raised by one after a step in which the cotangents the
        layer scaled reached the next layers with more than ``T/2`` of their entries below
        ``u_min`` (counted), lowered by one below ``T/32``; the layer's statistical scale is
        multiplied by ``2^k``."""
        return {k: int(v) for k, v in self._lift.items() if int(v)}

    @property
    def backoff(self) -> int:
        """The back-off exponent ``h`` (reads the device: for logging, not the training step).

        Every step with a non-finite gradient raises it by one, ``config.backoff_interval``
        finite steps in a row lower it by one; while it is ``h``, every decision aims ``2^-h``
        lower in the format's range, so that an overflow cannot recur step after step."""
        return int(self._backoff[0]) if self._backoff is not None else self._backoff_loaded[0]

    def get_scale(self) -> float:
        """The global scale ``G`` (a Python float; reads the device), or ``1.0`` when disabled;
        every gradient not yet unscaled is brought to carry ``G``.

        ``G`` is the scale of the backwards that cannot carry per-layer scales
        (``torch.autograd.grad(scaler.scale(loss), params, create_graph=True)``, a gradient
        penalty's first backward): GradScaler's dynamic scale, from ``init_scale`` (2^16),
        multiplied by ``backoff_factor`` after a skipped step and by ``growth_factor`` after
        ``growth_interval`` finite ones. Before the first such backward, and on a scaler that
        never runs one, ``G = config.init_scale · 2^-h`` (1 by default): the per-layer decisions
        need no global scale, and gradients brought to carry 1 are unscaled already.

        GradScaler's recipes treat the gradients as all scaled by ``get_scale()``: clipping
        them before ``unscale_`` at ``max_norm * scaler.get_scale()``, or dividing the gradients
        of ``torch.autograd.grad(scaler.scale(loss), params, create_graph=True)`` by it (that
        backward has one global scale, ``G``). So that these stay exact, a call between a
        backward and :meth:`unscale_` first multiplies each parameter's gradient by ``G`` over
        the per-layer scale it carries (:meth:`grad_scales`; a power-of-two ratio, applied to
        the fp32 ``.grad`` in one ``_foreach_mul_`` per scale); :meth:`unscale_` then divides
        them by ``G``. Called at other times it changes nothing.

        Like ``torch.amp.GradScaler.get_scale()`` it falls after every skipped step and recovers
        after ``config.backoff_interval`` finite ones, so the common idiom for an LR scheduler,
        ``before = scaler.get_scale(); scaler.step(opt); scaler.update(); stepped =
        scaler.get_scale() >= before``, tells a skipped step (until ``h`` reaches its cap,
        ``adaloss.solver.MAX_BACKOFF``; ``skipped_steps`` counts them all)."""
        if not self._enabled:
            return 1.0
        if regions.GLOBAL in self._regions:
            scale = float(self._regions.get(regions.GLOBAL, next(self._bound().parameters()).device))
        else:
            scale = self._config.init_scale * 2.0 ** -self.backoff
        self._carry(scale)
        return scale

    def get_growth_factor(self) -> float:
        """``growth_factor``: what a GradScaler-kept scale (:meth:`get_scale` after a global
        backward, an opaque region's) is multiplied by after ``growth_interval`` finite steps."""
        return self._regions.growth.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._regions.growth = self._regions.growth._replace(growth_factor=float(new_factor)).checked()

    def get_backoff_factor(self) -> float:
        """``backoff_factor``: what a GradScaler-kept scale is multiplied by after a skipped step."""
        return self._regions.growth.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._regions.growth = self._regions.growth._replace(backoff_factor=float(new_factor)).checked()

    def get_growth_interval(self) -> int:
        """``growth_interval``: finite steps in a row before a GradScaler-kept scale grows."""
        return self._regions.growth.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._regions.growth = self._regions.growth._replace(growth_interval=new_interval).checked()

    def get_init_scale(self) -> float:
        """``init_scale``: where a GradScaler-kept scale starts (2^16)."""
        return self._regions.growth.init_scale

    def set_init_scale(self, new_scale: float) -> None:
        self._regions.growth = self._regions.growth._replace(init_scale=float(new_scale)).checked()

    def _adopt_gradscaler(self, state_dict: dict[str, Any]) -> IncompatibleLayers:
        """Switch a running job from ``torch.amp.GradScaler``: its ``state_dict()``'s scale starts
        the GradScaler-kept scales (:meth:`get_scale` after a global backward, opaque regions'),
        with its schedule; its growth tracker is dropped; the per-layer decisions start fresh."""
        keys = ("scale", "growth_factor", "backoff_factor", "growth_interval")
        if any(k not in state_dict for k in keys):
            raise ValueError(
                "load_state_dict() takes AdaLossScaler.state_dict()'s output (it has a 'config' "
                "entry) or torch.amp.GradScaler.state_dict()'s (entries "
                f"{', '.join(keys)}); got entries {', '.join(map(repr, sorted(state_dict)))}")
        growth = regions.Growth(float(state_dict["scale"]), float(state_dict["growth_factor"]),
                                float(state_dict["backoff_factor"]), int(state_dict["growth_interval"]))
        self._regions.growth = growth.checked()
        self._regions.load_state_dict({})  # every kept scale starts again from it
        warnings.warn(
            f"load_state_dict(): a torch.amp.GradScaler state: its scale {growth.init_scale:g} starts "
            "the scale of global backwards and opaque regions (init_scale), with its growth_factor, "
            "backoff_factor and growth_interval; its growth tracker is dropped and the per-layer "
            "decisions start fresh (they need no history)", stacklevel=_user_stacklevel())
        return IncompatibleLayers([], [])

    def _carry(self, scale: float) -> None:
        """Bring the gradients the backwards since the last ``update()`` scaled, not unscaled
        yet, to carry ``scale`` (nothing else: a gradient left from before is not touched)."""
        groups: dict[tuple[Any, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for p, old in self._pending.values():
            if p.grad is None or p in self._routes:  # (an FSDP2 copy's: routed unscaled)
                continue
            grad = own_values(local_grad(p.grad))
            groups.setdefault((id(old), grad.device), (old, []))[1].append(grad)
        targets: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (_, dev), (old, grads) in groups.items():
                if dev not in targets:
                    targets[dev] = torch.full((), scale, dtype=_F32, device=dev)
                torch._foreach_mul_(grads, targets[dev] / old.to(dev))
        for key, (p, _) in list(self._pending.items()):
            if p.grad is not None and p not in self._routes:
                self._pending[key] = (p, targets[own_values(local_grad(p.grad)).device])

    @torch._disable_dynamo  # eager inside a compiled step (see torch_bridge.hooks)
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale(loss).backward(**kwargs)``."""
        self.scale(loss).backward(**kwargs)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """Apex's form: ``with scaler.scale_loss(loss, opt) as s: s.backward()``, then ``opt.step()``.

        On exit the gradients are unscaled and checked; if one is not finite, the
        next ``optimizer.step()`` is skipped (and counted). No ``update()`` is needed.
        """
        yield self.scale(loss)
        if not self._enabled:
            return
        self.unscale_(optimizer)
        skipped = self._found_inf(optimizer)
        self._skips.stepped(skipped)
        if skipped:
            _skip_next_step(optimizer)
        self._per_optimizer[id(optimizer)]["stage"] = _Stage.STEPPED
        self.update()

    def _on_leaf(self, param: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor,
                 old: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring a new gradient and an existing ``param.grad`` (accumulation; carrying ``old``,
        or what the last backward left) to one scale; with ``unscale_in_backward``, to scale 1."""
        if self._at_leaf:
            if grad.dtype == torch.float16:
                if param not in self._routes:
                    raise ValueError(_FP16_GRADS)
                self._routes.scales[id(param)] = scale  # unscaled in fp32 once accumulated
                return grad, scale
            return _times(grad, scale.reciprocal()), self._one(grad.device)
        if param.grad is None:
            return grad, scale
        if old is None:
            old = self._pending.get(id(param), (param, None))[1]
        old = torch.ones((), dtype=_F32, device=grad.device) if old is None else old
        with torch.no_grad():  # (a create_graph backward records only the products below)
            absmax = [own_values(param.grad).abs().amax().to(_F32), own_values(grad).abs().amax().to(_F32)]
            target = solver.merge_scale([old, scale], absmax, u_max(self._config, grad.dtype), xp)
            param.grad.mul_(target / old)
        return _times(grad, target / scale), target

    def _one(self, device: torch.device) -> torch.Tensor:
        """A 0-d fp32 one on ``device``, made once."""
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones((), dtype=_F32, device=device)
        return one

    def _on_done(self, record: BackwardRecord) -> None:
        self._schedule.saw(record.shapes, stacklevel=_user_stacklevel())
        if record.global_reason is not None and not self._warned_global:
            self._warned_global = True
            warnings.warn(_GLOBAL_BACKWARD.format(how=record.global_reason), stacklevel=_user_stacklevel())
        self._skips.records.append(record)
        self._last = record
        self._pending.update(record.leaf_scales)
        self._model_scales.update(record.model_scales)
        self._spreads.update(record.spreads)
        for name, r in record.underflow.items():
            old = self._ratio.get(name)
            self._ratio[name] = r if old is None else torch.maximum(old, r)

    # -- unscale / step / update ---------------------------------------------------------
    @torch._disable_dynamo  # eager inside a compiled step (see torch_bridge.hooks)
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide each gradient of ``optimizer``'s parameters by its own scale, in place,
        and record whether any is inf/NaN (on device)."""
        if not self._enabled:
            return
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        groups: dict[tuple[Any, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        found: dict[torch.device, torch.Tensor] = state["found_inf"]
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    if id(p) in self._routes.routed:
                        raise RuntimeError(
                            "FSDP2 did not reduce-scatter the fp32 gradient AdaLossScaler unscaled for an "
                            f"fp16 parameter (torch {torch.__version__}): its internals may have changed. "
                            "Use param_dtype=None with torch.autocast(dtype=torch.float16).")
                    continue
                grad = local_grad(p.grad)
                if grad.dtype == torch.float16:
                    raise ValueError(_FP16_GRADS)
                grad = own_values(grad)
                dev = grad.device
                entry = self._pending.pop(id(p), None)
                scale = self._one(dev) if entry is None else entry[1]
                key = (id(scale), dev, grad.dtype)
                groups.setdefault(key, (scale, []))[1].append(grad)
                if dev not in found:  # (setdefault would make a tensor per parameter)
                    found[dev] = torch.zeros((), dtype=_F32, device=dev)
        if self._sharded and not found:  # no gradient in this rank's shards: still agree
            dev = local_grad(next(self._model.parameters())).device  # a shard's device
            found[dev] = torch.zeros((), dtype=_F32, device=dev)
        with torch.no_grad():
            for (_, dev, _), (scale, grads) in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found[dev], scale.reciprocal())
        if self._sharded:
            agree_found_inf(found)
        state["stage"] = _Stage.UNSCALED

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        found = self._per_optimizer[id(optimizer)]["found_inf"]
        if not found:
            raise RuntimeError("No inf checks were recorded for this optimizer: none of its parameters "
                               "has a gradient.")
        return bool(sum(v.item() for v in found.values()))

    @torch._disable_dynamo  # eager inside a compiled step (see torch_bridge.hooks)
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` was called) and run ``optimizer.step(*args, **kwargs)``
        unless a gradient is inf/NaN; then the step is skipped and counted."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if AdaLossScaler is enabled.")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        if not state["found_inf"]:
            state["stage"] = _Stage.READY
        retval = None
        skipped = self._found_inf(optimizer)
        self._skips.stepped(skipped)
        if not skipped:
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return retval

    @torch._disable_dynamo  # eager inside a compiled step (see torch_bridge.hooks)
    def update(self) -> None:
        """End the iteration: reset per-optimizer state, advance the ``update_every`` counter."""
        if not self._enabled:
            return
        if not any(s["found_inf"] for s in self._per_optimizer.values()):
            raise RuntimeError("No inf checks were recorded prior to update(): call step() "
                               "(or unscale_()) first.")
        self._iteration += 1
        self._passes.clear()
        found_inf = [f for s in self._per_optimizer.values() for f in s["found_inf"].values()]
        if self._regions:
            self._regions.update(found_inf)
        h, good = self._backoff if self._backoff is not None else (None, None)
        by_device: dict[torch.device, list[str]] = {} if h is None else {h.device: []}
        for name, ratio in self._ratio.items():
            if name not in self._lift:
                self._lift[name] = torch.zeros((), dtype=torch.int32, device=ratio.device)
            by_device.setdefault(self._lift[name].device, []).append(name)
        for dev, names in by_device.items():  # one compiled kernel per device with fuse_decisions
            here = h is not None and h.device == dev
            state = [h if here else None, good if here else None, *(self._lift[n] for n in names)]
            ratios = [self._ratio[n].to(dev) for n in names]
            args = (*state[:2], state[2:], ratios, found_total(found_inf, dev))
            fused = self._schedule.fused if self._schedule.active else None
            new_h, new_good, new_lifts = (fused(decisions.levels, (self._config,), *args) if fused is not None
                                          else decisions.levels(self._config, xp, *args))
            for old, value in zip(state, [new_h, new_good, *new_lifts]):
                if old is not None:
                    old.copy_(value)
        self._ratio = {}
        said = self._skips.end_iteration(self._model, self._last, self._iteration)
        if said is not None:
            warnings.warn(said, skips.SkippedStepsWarning, stacklevel=_user_stacklevel())
        self._per_optimizer.clear()
        self._pending.clear()
        self._routes.routed.clear()

    # -- telemetry ----------------------------------------------------------------------
    def grad_scales(self) -> dict[str, torch.Tensor]:
        """``{parameter name: fp32 scale}`` carried by each parameter's gradient in the last backward
        (1 everywhere with ``unscale_in_backward``; :meth:`layer_reports` keeps the decisions)."""
        if self._last is None:
            return {}
        names = self._names()
        return {names[i]: s for i, (_, s) in self._last.leaf_scales.items() if i in names}

    def coverage(self) -> Coverage | None:
        """Matmul/convolution nodes, layers scaled and opaque regions of the last ``scale()``'d
        graph (``None`` before the first); see :class:`adaloss.report.Coverage`."""
        return self._coverage

    def cast_sites(self) -> dict[str, str]:
        """What each cast decision of the last ``scale()``'d graph casts, by its name
        (``{"cast:0": "float16 → float32 (8, 16, 40) at LogSoftmaxBackward0"}``: the cotangent's
        dtype, the widened tensor's, its shape when first planned, and the autograd node)."""
        return dict(self._cast_sites)

    def layer_reports(self) -> dict[str, LayerReport]:
        """Per-layer scale decisions and statistics of the last backward (forward order)."""
        return {} if self._last is None else self._last.reports()

    def captured_cotangents(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer: (incoming cotangent as carried, its scale)}`` of the last backward
        (``capture=True``); see :func:`torch_bridge.underflow.compare_cotangents`."""
        if self._last is None:
            return {}
        return {k: (v, self._last.captured_scales[k]) for k, v in self._last.captured.items()}

    # -- pickling and copies ------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The scaler's state without its model (a copy refers to the same one), the graphs, hooks
        and compiled calls of its backwards; the scales of gradients not yet unscaled by
        parameter name."""
        state = self.__dict__.copy()
        names = self._names() if self._model is not None else {}
        state.update(
            _model=None, _model_names=self._parameter_names(),
            _pending={names[k]: scale for k, (_, scale) in self._pending.items() if k in names},
            _last=None, _plans=OrderedDict(), _ones={}, _passes=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        pending = state.pop("_pending")
        self.__dict__.update(state)
        self._attach(_MODELS.get(self._token), pending)

    def __deepcopy__(self, memo: dict[int, Any]) -> AdaLossScaler:
        """A copy on the same model, or on its copy where the same ``deepcopy`` copied it."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = copy.deepcopy(self.__getstate__(), memo)
        new.__setstate__(state)
        model = memo.get(id(self._model))
        if model is not None and model is not self._model:
            new._token = _register(model)
            new._attach(model, state["_pending"])
        return new

    def _attach(self, model: torch.nn.Module | None, pending: dict[str, torch.Tensor]) -> None:
        """Refer to ``model`` (``None``: not in this process; :meth:`scale` raises) with the scales
        its gradients carry (by name); the per-optimizer stages hold only in the process of the
        optimizers (keyed by object)."""
        self._model = model
        self._pending = {}
        if model is None:
            self._per_optimizer = defaultdict(_fresh_state)
            return
        params = dict(model.named_parameters())
        self._pending = {id(params[n]): (params[n], s) for n, s in pending.items() if n in params}

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Config, counters and the cached statistical scales (``update_every``); ``{}`` if disabled."""
        if not self._enabled:
            return {}
        return {"config": dataclasses.asdict(self._config), "iteration": self._iteration,
                "skipped_steps": self._skips.steps, "parameters": self._parameter_names(),
                "model_scales": {k: v.detach().clone() for k, v in self._model_scales.items()},
                "region_scales": self._regions.state_dict(), "growth": self._regions.growth._asdict(),
                "backoff": (self.backoff, int(self._backoff[1]) if self._backoff is not None
                            else self._backoff_loaded[1]),
                "lift": {k: int(v) for k, v in self._lift.items()},
                "skips": self._skips.state_dict()}

    def _parameter_names(self) -> list[str]:
        """The names layers can be named after: the model's parameters, in its order."""
        if self._model is None:
            return list(self._model_names)
        return list(parameter_names(self._model).values())

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> IncompatibleLayers:
        """Restore :meth:`state_dict`'s output. The state names the model's parameters: with
        ``strict`` (the default) a state saved for another model, or for this one with layers
        renamed, raises ``RuntimeError`` naming the parameters missing from it and those it has
        that the model lacks; with ``strict=False`` the entries of parameters the model has are
        loaded, the others dropped (those layers start fresh), and the names are returned, as
        ``nn.Module.load_state_dict`` does. A ``torch.amp.GradScaler.state_dict()`` (a job
        switched from GradScaler) is adopted: its scale and schedule start the GradScaler-kept
        scales, its growth tracker is dropped, and a warning says so."""
        if not self._enabled:
            return IncompatibleLayers([], [])
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a "
                               "disabled instance of AdaLossScaler.")
        if "config" not in state_dict:
            return self._adopt_gradscaler(state_dict)
        mine = dataclasses.asdict(self._config)
        # a field added since the checkpoint was written compares at its default
        saved = {**dataclasses.asdict(AdaLossConfig()), **state_dict["config"]}
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        if diff:
            raise ValueError("state_dict was saved with a different AdaLossConfig "
                             f"(fields: {', '.join(diff)})")
        mine = self._parameter_names()
        names = set(mine)
        saved_names = state_dict.get("parameters")  # absent from states saved before it existed
        keyed = list(state_dict["model_scales"]) + list(state_dict.get("lift", {}))
        unexpected = [w for w in dict.fromkeys([*(saved_names or ()), *map(_weight_key, keyed)])
                      if w is not None and w not in names]
        saved = set(saved_names or ())
        missing = [] if saved_names is None else [n for n in mine if n not in saved]
        if strict and (missing or unexpected):
            raise RuntimeError(_mismatch(missing, unexpected, saved_names, mine))
        dropped = set(unexpected)
        keep = lambda k: _weight_key(k) not in dropped  # noqa: E731  (structural keys: None)
        self._iteration = int(state_dict["iteration"])
        # (no "skips" in states saved before it existed)
        self._skips.load_state_dict(int(state_dict["skipped_steps"]), state_dict.get("skips", {}))
        self._model_scales = {k: v.clone() for k, v in state_dict["model_scales"].items() if keep(k)}
        self._regions.load_state_dict(state_dict.get("region_scales", {}))
        if "growth" in state_dict:
            self._regions.growth = regions.Growth(**state_dict["growth"]).checked()
        self._backoff_loaded = tuple(int(v) for v in state_dict.get("backoff", (0, 0)))  # type: ignore[assignment]
        self._backoff = None
        self._lift = {k: torch.tensor(int(v), dtype=torch.int32)
                      for k, v in state_dict.get("lift", {}).items() if keep(k)}
        self._ratio = {}
        return IncompatibleLayers(missing, unexpected)


class IncompatibleLayers(NamedTuple):
    """What :meth:`AdaLossScaler.load_state_dict` with ``strict=False`` could not match:
    parameters of the model the state has no entry for, and parameters it names that the
    model lacks (their entries were dropped)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# decisions named after the graph, not a parameter: casts, opaque regions
_STRUCTURAL = ("cast:", "region:")


def _weight_key(key: str) -> str | None:
    """The parameter a state entry belongs to (``w@1`` -> ``w``), None for a structural one."""
    return None if key.startswith(_STRUCTURAL) else weight_of(key)


def _mismatch(missing: list[str], unexpected: list[str], saved: list[str] | None,
              mine: list[str]) -> str:
    def some(names: list[str]) -> str:
        return ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
    parts = ["AdaLossScaler.load_state_dict: the state was saved for another model (or for this "
             "one with layers renamed)."]
    if missing:
        parts.append(f"Parameters of this model it has no entry for: {some(missing)}.")
    if unexpected:
        parts.append(f"Parameters it names that this model lacks: {some(unexpected)}.")
    hint = _prefix_hint(saved, mine)
    if hint:
        parts.append(hint)
    parts.append("Load it into the scaler of the model it was saved from, or pass strict=False to "
                 "load the entries that match (the other layers start fresh).")
    return " ".join(parts)


def _prefix_hint(saved: list[str] | None, mine: list[str]) -> str | None:
    """Say so when the names differ only by a module prefix (``module.`` from DDP,
    ``_orig_mod.`` from torch.compile)."""
    if not saved or not mine or len(saved) != len(mine):
        return None
    for a, b, how in ((saved, mine, "saved names carry"), (mine, saved, "this model's names carry")):
        first = a[0]
        for i, ch in enumerate(first):
            if ch != ".":
                continue
            prefix = first[:i + 1]
            if all(n.startswith(prefix) for n in a) and [n[len(prefix):] for n in a] == b:
                return (f"The {how} the extra prefix {prefix!r}: build the scaler on the same "
                        "module as the one that saved it (the wrapped model or model.module, "
                        "not one and the other).")
    return None


_FP16_GRADS = ("Attempting to unscale FP16 gradients. Each gradient carries its own scale (up to the "
               "accumulated bound), and dividing it in fp16 would flush its small entries to zero. Keep "
               "fp32 parameters and run the forward under torch.autocast(dtype=torch.float16) instead "
               "of model.half().")


_GLOBAL_BACKWARD = (
    "AdaLossScaler: a scaled backward ran as {how} (a gradient penalty's recipe), which cannot carry "
    "per-layer scales (autograd would record the decisions, which are not differentiable): it uses "
    "one global scale, scaler.get_scale(), kept as GradScaler keeps its scale (from init_scale, 2^16), "
    "which its gradients carry (as with GradScaler, divide them by it). The other backwards keep "
    "per-layer scales. (Said once per scaler.)")

#: token -> model, for the copies of a scaler (pickled or deep-copied) to find the model it was
#: built on in this process (a scaler refers to its model, it does not carry a copy)
_MODELS: weakref.WeakValueDictionary[str, torch.nn.Module] = weakref.WeakValueDictionary()


def _register(model: torch.nn.Module) -> str:
    token = uuid.uuid4().hex
    _MODELS[token] = model
    return token



def _times(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t · factor`` (:func:`torch_bridge.hooks.rescale`; a sparse ``t`` stays sparse)."""
    return t * factor if t.is_sparse else rescale(t, factor)


def _warn_foreign(plan: ScalePlan, names: dict[int, str], model: torch.nn.Module) -> None:
    """Say so when a backward reaches parameters but none of the scaler's model's."""
    reached = [p for p in plan.params if isinstance(p, torch.nn.Parameter)]  # (not a data input)
    if reached and not any(id(p) in names for p in reached):
        warnings.warn(
            f"AdaLossScaler: this backward reaches {len(reached)} parameter(s), none of them a parameter "
            f"of the scaler's model ({type(model).__name__}): its layers are scaled and unscaled, but "
            "named after shapes, so state_dict(), the per-layer feedback and grad_scales() cannot follow "
            "them. Build the scaler on the module the loss is computed from (several: "
            "AdaLossScaler(torch.nn.ModuleList([...]))).", stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside torch_bridge and
    torch (the training loop, past ``update()`` and dynamo's wrappers), for its caller."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
            "torch_bridge", "torch", "contextlib", "accelerate", "lightning"):
        frame, level = frame.f_back, level + 1
    return level


def _data_parallel() -> bool:
    """Whether gradients may be reduced across ranks: ``torch.distributed`` initialized, >1 rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _warn_coverage(plan: ScalePlan) -> None:
    """Say once per graph structure when matmuls/convolutions that should scale do not."""
    cov = plan.coverage
    opaque = no_layer = None
    rnns = sum(p.kind == "rnn" for p in plan.order)
    said = []
    if cov.opaque_regions > rnns:
        said.append(f"{cov.opaque_regions - rnns} opaque region(s) (torch.compile, reentrant "
                    "torch.utils.checkpoint, or a custom autograd Function using parameters) get one "
                    "scale decision at their boundary and no per-layer scale inside; for per-layer "
                    "scales, run the model uncompiled and use checkpoint(..., use_reentrant=False)")
    if rnns:
        said.append(f"{rnns} fused RNN node(s) (an nn.LSTM/GRU/RNN run by cuDNN, MIOpen or oneDNN: "
                    "every time step's matmuls in one kernel) get one scale decision each, sized for "
                    "their weight gradients summed over time steps and batch, and no per-gate scale "
                    "inside; for per-layer scales, run the RNN unfused (under "
                    "torch.backends.cudnn.flags(enabled=False) on CUDA, "
                    "torch.backends.mkldnn.flags(enabled=False) on CPU) or as a loop over nn.LSTMCell")
    if said:
        opaque = "; ".join(said)
    if plan.no_layer:
        no_layer = (f"no layer found among {cov.weighted_ops} matmul/convolution nodes: none has one "
                    "operand computed from parameters of the scaler's model alone (frozen or foreign "
                    "weights are data)")
    warn_coverage(opaque, plan.missed, no_layer, stacklevel=3)


def _skip_next_step(optimizer: torch.optim.Optimizer) -> None:
    """Make the next ``optimizer.step()`` a no-op, once (Apex's overflow handling)."""
    had = "step" in optimizer.__dict__
    original = optimizer.__dict__.get("step")

    def skip(*args: Any, **kwargs: Any) -> None:
        if had:
            optimizer.step = original
        else:
            del optimizer.step
        return None

    optimizer.step = skip
