"""AdaLossConfig: validation names the field and the allowed range; formats from finfo."""

import dataclasses
import subprocess
import sys

import ml_dtypes
import pytest

from adaloss import AdaLossConfig, format_limits
from adaloss.config import UNBOUNDED


@pytest.mark.parametrize("field, value", [
    ("threshold", 0.0), ("threshold", 0.7), ("threshold", float("nan")),
    ("model", "mean"), ("grad_format", "float32"), ("layer_bound", 0.5),
    ("accum_bound", float("inf")), ("init_scale", -1.0), ("update_every", 0),
    ("update_every", 2.0), ("relu_fraction", 0.0), ("u_min", -1.0), ("power_of_two", 1),
    ("saturation", 0.0), ("fp8_rule", "delayed"), ("operand_format", "float16"),
    ("operand_format", "float8_e4m3fn"),  # with the default fp16 grad_format
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"AdaLossConfig\.{field} must be"):
        AdaLossConfig(**{field: value})


def test_u_min_must_be_below_u_max():
    with pytest.raises(ValueError, match="u_min"):
        AdaLossConfig(u_min=1.0, u_max=0.5)


def test_config_is_frozen_and_hashable():
    cfg = AdaLossConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.threshold = 0.1  # type: ignore[misc]
    assert hash(cfg) == hash(AdaLossConfig())


@pytest.mark.parametrize("name, dtype", [("float16", "float16"), ("bfloat16", ml_dtypes.bfloat16)])
def test_format_limits_come_from_finfo(name, dtype):
    info = ml_dtypes.finfo(dtype)
    lim = format_limits(name)
    assert lim == (float(info.smallest_normal), float(info.max), float(info.smallest_subnormal))
    cfg = AdaLossConfig(grad_format=name)
    assert cfg.underflow_limit == float(info.smallest_normal)
    assert cfg.layer_limit == cfg.accum_limit == UNBOUNDED


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float32"])
def test_formats_no_cotangent_is_stored_in_are_refused(name):
    with pytest.raises(ValueError, match="grad_format"):
        AdaLossConfig(grad_format=name)


def test_authors_preset():
    cfg = AdaLossConfig.authors_preset()
    assert (cfg.layer_limit, cfg.accum_limit, cfg.underflow_limit, cfg.overflow_limit) == (
        16.0, 1024.0, 6.0e-8, 65504.0)
    assert cfg.model == "gradient" and cfg.power_of_two and cfg.threshold == 1e-3
    assert AdaLossConfig.authors_preset("product").model == "product"


def test_core_package_imports_neither_jax_nor_torch():
    code = ("import sys, adaloss, adaloss.solver; "
            "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
