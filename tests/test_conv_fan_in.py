"""A convolution's fan-in is the number of terms summed into an entry of its input gradient, for
every kind (strided, dilated, grouped, transposed) in both fronts: checked against a brute-force
count (the input gradient of the same convolution with every weight and every output cotangent
1: each entry is its number of terms), and equal between JAX and PyTorch for the same layer."""

from __future__ import annotations

import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest
import torch

import jax_adaloss
from adaloss.fan_in import conv_fan_in, taps_per_entry
from torch_bridge.graph import ScalePlan, parameter_names

# (module, spatial size): large enough that some input entry is away from every border
TORCH = {
    "conv1d-stride2": (lambda: torch.nn.Conv1d(4, 6, 3, stride=2), (17,)),
    "conv2d-groups-dilation": (lambda: torch.nn.Conv2d(4, 6, 3, dilation=2, groups=2), (13, 13)),
    "conv2d-depthwise-stride2": (lambda: torch.nn.Conv2d(4, 8, 4, stride=2, groups=4), (14, 14)),
    "conv3d-stride": (lambda: torch.nn.Conv3d(2, 4, 3, stride=(1, 2, 3)), (9, 9, 11)),
    "convT1d-stride2-dilation": (lambda: torch.nn.ConvTranspose1d(4, 6, 3, stride=2, dilation=2), (9,)),
    "convT2d-dcgan": (lambda: torch.nn.ConvTranspose2d(32, 16, 4, 2, 1), (6, 6)),
    "convT2d-dcgan-rgb": (lambda: torch.nn.ConvTranspose2d(16, 3, 4, 2, 1), (6, 6)),
    "convT2d-groups": (lambda: torch.nn.ConvTranspose2d(4, 6, 3, stride=3, groups=2), (6, 6)),
    "convT3d": (lambda: torch.nn.ConvTranspose3d(2, 4, (2, 3, 3), stride=2), (4, 4, 4)),
}


def _torch_fan_in(conv: torch.nn.Module, size: tuple[int, ...]) -> tuple[int, int]:
    """(the scaler's plan's fan-in, the brute-force count) of ``conv`` on an input of ``size``."""
    x = torch.randn(2, conv.in_channels, *size, requires_grad=True)
    plan = ScalePlan(conv(x).square().sum().grad_fn, parameter_names(conv))
    (layer,) = [p for p in plan.layers() if p.kind == "layer"]
    ones = conv.__class__(**{**_init_args(conv), "bias": False})
    torch.nn.init.ones_(ones.weight)
    x1 = torch.ones_like(x, requires_grad=True)
    (dx,) = torch.autograd.grad(ones(x1), x1, torch.ones_like(ones(x1)))
    return layer.fan_in, int(dx.max())


def _init_args(conv: torch.nn.Module) -> dict:
    keys = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups")
    return {k: getattr(conv, k) for k in keys}


@pytest.mark.parametrize("case", sorted(TORCH))
def test_torch_conv_fan_in_is_the_brute_force_count(case):
    make, size = TORCH[case]
    planned, counted = _torch_fan_in(make(), size)
    assert planned == counted, (case, planned, counted)


def test_dcgan_transposed_convs_count_their_output_channels():
    # ConvTranspose2d(32, 16, 4, 2, 1): each input entry meets every one of the 16·4·4 taps
    assert _torch_fan_in(torch.nn.ConvTranspose2d(32, 16, 4, 2, 1), (6, 6))[0] == 256
    assert _torch_fan_in(torch.nn.ConvTranspose2d(16, 3, 4, 2, 1), (6, 6))[0] == 48


def _jax_fan_in(conv, x: jax.Array) -> tuple[int, int]:
    """(the sweep's fan-in, the brute-force count) of ``conv(w, x)`` for a weight ``w``."""
    w = conv.init_weight()

    def loss(w, x):
        return jnp.sum(jnp.square(conv(w, x.astype(jnp.float16)).astype(jnp.float32)))

    vg = jax_adaloss.value_and_grad(loss, argnums=(0, 1), weights=0, return_report=True)
    (_, _), rep = vg(w, x, adaloss_state=None)
    (layer,) = [r for name, r in rep.layers.items() if not name.startswith("cast:")]
    ones = jnp.ones_like(w, jnp.float32)
    y, vjp = jax.vjp(lambda x: conv(ones, x), jnp.ones_like(x, jnp.float32))
    (dx,) = vjp(jnp.ones_like(y))
    return int(layer.fan_in), int(dx.max())


class _Flax:
    def __init__(self, module: fnn.Module, x_shape: tuple[int, ...]) -> None:
        self.module, self.x = module, jnp.ones(x_shape)

    def init_weight(self) -> jax.Array:
        params = self.module.init(jax.random.key(0), self.x)["params"]
        return params["kernel"].astype(jnp.float16)

    def __call__(self, w, x):
        return self.module.apply({"params": {"kernel": w}}, x)


class _Lax:
    def __init__(self, fn, w_shape: tuple[int, ...]) -> None:
        self.fn, self.w_shape = fn, w_shape

    def init_weight(self) -> jax.Array:
        return (0.1 * jax.random.normal(jax.random.key(0), self.w_shape)).astype(jnp.float16)

    def __call__(self, w, x):
        return self.fn(x, w.astype(x.dtype))


# flax's nn.Conv and nn.ConvTranspose (strided, grouped) are rows of the coverage table
# (tests/test_coverage_table.py), checked against the same count there
JAX = {
    "lax-conv_transpose": lambda: (_Lax(lambda x, w: jax.lax.conv_transpose(
        x, w, (2, 3), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), (4, 3, 4, 5)), (2, 6, 6, 4)),
    "lax-lhs_dilation-and-stride": lambda: (_Lax(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (2,), [(1, 1)], lhs_dilation=(2,), rhs_dilation=(1,)), (5, 4, 4)), (2, 4, 16)),
}


@pytest.mark.parametrize("case", sorted(JAX))
def test_jax_conv_fan_in_is_the_brute_force_count(case):
    conv, x_shape = JAX[case]()
    x = jax.random.normal(jax.random.key(1), x_shape)
    planned, counted = _jax_fan_in(conv, x)
    assert planned == counted, (case, planned, counted)


def test_jax_and_torch_fan_ins_are_equal():
    """A strided, dilated, grouped convolution and a strided, dilated transposed one: equal in the
    two fronts, and the count."""
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 4))
    pairs = ((fnn.Conv(6, (4, 4), strides=2, kernel_dilation=3, feature_group_count=2, use_bias=False),
              torch.nn.Conv2d(4, 6, 4, stride=2, dilation=3, groups=2)),
             (fnn.ConvTranspose(6, (4, 4), strides=(2, 2), kernel_dilation=(2, 2), use_bias=False),
              torch.nn.ConvTranspose2d(4, 6, 4, stride=2, dilation=2)))
    for flax_conv, torch_conv in pairs:
        got_jax = _jax_fan_in(_Flax(flax_conv, x.shape), x)
        assert got_jax == _torch_fan_in(torch_conv, (16, 16))
        assert got_jax[0] == got_jax[1]


def test_taps_per_entry_by_hand():
    assert taps_per_entry(3) == 3 and taps_per_entry(4, stride=2) == 2 and taps_per_entry(3, stride=2) == 2
    assert taps_per_entry(4, stride=4) == 1  # a patch embedding: every input entry in one patch
    assert taps_per_entry(3, stride=2, dilation=2) == 3  # even offsets: every tap on one residue
    assert conv_fan_in(16, 1, (4, 4), lhs_dilation=(2, 2)) == 256
    with pytest.raises(ValueError, match="groups"):
        conv_fan_in(6, 4, (3,))
    with pytest.raises(ValueError, match="stride"):
        taps_per_entry(3, stride=0)
