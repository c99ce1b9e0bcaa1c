"""jit and a 4-device CPU mesh give the same scales and gradients as one device."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from models import make_case, xent

import jax_adaloss


def _loss(cls):
    def loss(p, x, y):
        return 1e-6 * xent(cls(dtype=jnp.float16).apply(p, x.astype(jnp.float16)), y)
    return loss


def test_jit_matches_eager():
    cls, params, x, y = make_case("residual", jax.random.key(0))
    f = jax_adaloss.value_and_grad(_loss(cls), return_report=True)
    (v1, g1), r1 = f(params, x, y)
    (v2, g2), r2 = jax.jit(f)(params, x, y)
    # same scales, bit for bit (statistics may differ in the last bits)
    assert r1.layers.keys() == r2.layers.keys()
    for k in r1.layers:
        for field in ("scale", "incoming_scale", "outgoing_scale"):
            assert float(getattr(r1.layers[k], field)) == float(getattr(r2.layers[k], field))
    # XLA fuses fp16 elementwise chains under jit: gradients agree to fp16 rounding
    leaves = lambda g: jax.tree.leaves(g, is_leaf=jax_adaloss.is_scaled_grad)
    for a, b in zip(leaves(g1), leaves(g2)):
        np.testing.assert_allclose(a.value, b.value, rtol=5e-3, atol=5e-3 * float(jnp.abs(a.value).max()))
        assert float(a.scale) == float(b.scale)
        # the measured underflow signal counts entries below u_min, and an entry at the limit
        # may round to either side of it: the counts agree to a few entries (here, one entry
        # of a 128 x 64 cotangent moves the signal by 0.24)
        if a.underflow is not None:
            assert abs(float(a.underflow) - float(b.underflow)) <= 0.25 * max(float(b.underflow), 1.0) + 0.5


SHARDED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from models import make_case
    from test_jit_and_sharding import _loss
    import jax_adaloss, optax
    assert jax.device_count() == 4
    cls, params, x, y = make_case("mlp", jax.random.key(0))
    x, y = jnp.tile(x, (2, 1)), jnp.tile(y, 2)  # 64 rows: 16 per device
    f = jax.jit(jax_adaloss.value_and_grad(_loss(cls), return_report=True))
    (v1, g1), r1 = f(params, x, y)
    mesh = jax.make_mesh((4,), ("data",))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ys = jax.device_put(y, NamedSharding(mesh, P("data")))
        ps = jax.device_put(params, NamedSharding(mesh, P()))
        (v4, g4), r4 = f(ps, xs, ys)
        tx = jax_adaloss.adaloss(inner=optax.adam(1e-3))
        state = tx.init(ps)
        (_, g4), _ = f(ps, xs, ys, adaloss_state=state)
        upd, _ = jax.jit(tx.update)(g4, state, ps)
    assert len(xs.sharding.device_set) == 4
    s1 = {{k: float(l.scale) for k, l in r1.layers.items()}}
    s4 = {{k: float(l.scale) for k, l in r4.layers.items()}}
    assert s1 == s4, (s1, s4)
    plain = lambda g: jax.tree.leaves(jax_adaloss.unscale_tree(g))
    for a, b in zip(plain(g1), plain(g4)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # an all-reduce sums in another order: allow fp16 rounding of the result
        err = np.abs(a - b).max() / np.abs(a).max()
        assert err < 5e-3, err
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(upd))
    print("OK", s4)
""")


def test_four_device_mesh_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", SHARDED.format(tests=here)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout
