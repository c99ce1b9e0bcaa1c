"""``jax.nn.dot_product_attention`` in an fp16 block runs under the scaled backward wherever
``jax.grad`` runs: on CPU its ``F16_F16_F32`` dot algorithm, which XLA:CPU cannot lower, takes the
default precision (``jax.nn.dot_product_attention``'s own fallback), and the block gets the
decisions and gradients of the same attention written with einsums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_adaloss

B, T, N, H = 2, 8, 2, 8
D = N * H


def _params():
    ks = jax.random.split(jax.random.key(0), 5)
    return {n: jax.random.normal(k, (D, D)) * 0.25 for n, k in zip(("w0", "wq", "wk", "wv", "wo"), ks)}


def _einsum_attention(q, k, v):
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) / np.sqrt(H)
    causal = jnp.tril(jnp.ones((T, T), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("BNTS,BSNH->BTNH", probs.astype(q.dtype), v)


def _loss(attention):
    def loss(p, x, dtype=jnp.float16):
        h = jax.nn.gelu(x.astype(dtype) @ p["w0"].astype(dtype))
        q, k, v = ((h @ p[n].astype(dtype)).reshape(B, T, N, H) for n in ("wq", "wk", "wv"))
        a = attention(q, k, v).reshape(B, T, D)
        return 1e-6 * jnp.mean(jnp.square((h + a @ p["wo"].astype(dtype)).astype(jnp.float32)))
    return loss


def test_dot_product_attention_scales_like_the_einsum_attention():
    params, x = _params(), jax.random.normal(jax.random.key(1), (B, T, D))
    fused = _loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    ref = jax.grad(_loss(_einsum_attention))(params, x, jnp.float32)
    runs = {}
    for name, loss in (("fused", fused), ("einsum", _loss(_einsum_attention))):
        vg = jax_adaloss.value_and_grad(loss, return_report=True)
        runs[name] = jax.jit(lambda p, x, vg=vg: vg(p, x, adaloss_state=None))(params, x)
    (_, grads), rep = runs["fused"]
    assert {"wq", "wk", "wv", "wo"} <= set(rep.layers)  # the projections around it are layers
    assert rep.coverage == runs["einsum"][1].coverage and rep.coverage.opaque_regions == 0
    for layer, r in rep.layers.items():
        assert float(r.scale) == float(runs["einsum"][1].layers[layer].scale), layer
    assert max(float(r.scale) for r in rep.layers.values()) > 1.0  # loss x1e-6: decisions lift it
    for name, g in jax_adaloss.unscale_tree(grads).items():
        err = float(jnp.linalg.norm(g - ref[name]) / jnp.linalg.norm(ref[name]))
        assert err < 2e-2, (name, err)
