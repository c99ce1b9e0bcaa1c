"""Cost of data parallelism with adaptive loss scaling: communication and step time, both frameworks.

    python benchmarks/data_parallel.py                    # JAX on 4 CPU devices, torch on 2 gloo ranks
    python benchmarks/data_parallel.py --json out.json --frameworks jax

JAX: the linen LM of ``benchmarks/depth.py`` under ``shard_map`` over 4 (forced) CPU devices,
its gradient with ``jax_adaloss.grad`` against ``jax.grad`` of the same fp16 model under a fixed
loss scale (``jmp.StaticLossScale(2^15)``), in the two ways users reduce it: ``check_vma`` (the
backward sums replicated parameters' gradients; adaloss agrees on one scale first) and
``check_vma=False`` with ``jax_adaloss.pmean`` against ``jax.lax.pmean``. Reported: all-reduces
in the compiled HLO (count and bytes: the communication), median step time, and the error of the
unscaled gradients against the one-device full batch (adaloss) and against the loss-x1 gradients
(as in the model zoo).

torch: HF GPT2 (``--torch-dim``, ``--torch-layers``) in ``DistributedDataParallel`` and under FSDP2
(``fully_shard`` per block, fp32 reductions) on 2 gloo ranks, a training step with ``AdaLossScaler``
(gradients unscaled in the backward) against ``torch.amp.GradScaler``, timed in alternation on
rank 0. The traffic is the same by construction (fp32 buckets or shards, the same hooks).

Not a test: timings depend on the machine (here, 2 cores shared by every device or rank).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jmp  # noqa: E402
import numpy as np  # noqa: E402
from depth import LM, _time  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_adaloss  # noqa: E402
from adaloss_study.parallel_tables import table, torch_line  # noqa: E402
from adaloss_zoo.metrics import grad_error  # noqa: E402

_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "pred": 1, "s8": 1, "u8": 1}


def all_reduces(hlo: str) -> tuple[int, int]:
    """(count, bytes) of the all-reduce results in compiled HLO text."""
    count = size = 0
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
        if m is None:
            continue
        count += 1
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            size += n * _BYTES.get(dtype, 4)
    return count, size


def _named(tree: Any) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(k): np.asarray(v, np.float64) for k, v in leaves}


def _error(got: Any, ref: Any) -> float:
    """Worst relative error over the parameters but the attention key biases (whose gradient is
    zero analytically, under softmax's shift invariance: the reference is rounding noise)."""
    return grad_error(_named(got), _named(ref), exclude=("['key']['bias']",)).worst


def measure_jax(devices: int, blocks: int, dim: int, seq: int, per_device: int, factor: float,
                repeats: int, steps: int) -> dict[str, Any]:
    vocab, batch = 256, devices * per_device
    model = LM(vocab, dim, 4, blocks)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)))
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(0), x[:1])

    def token_loss(m: Any) -> Any:
        def loss(p: Any, x: jax.Array, y: jax.Array, share: float) -> jax.Array:
            logp = jax.nn.log_softmax(m.apply(p, x).astype(jnp.float32))
            # the sum over this shard's tokens, as a share of the full batch's mean
            return -factor * share * jnp.sum(jnp.take_along_axis(logp, y[..., None], -1)) / (batch * seq)
        return loss

    loss = token_loss(model)
    mesh = jax.make_mesh((devices,), ("data",))
    shard = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, shard), jax.device_put(y, shard)

    def unscaled(g: Any) -> Any:
        return jax.tree.map(lambda v: v / factor, jax_adaloss.unscale_tree(g))

    static = jmp.StaticLossScale(jnp.float32(2.0**15))  # the baseline: a fixed 2^15

    def jmp_grad(p: Any, x: jax.Array, y: jax.Array, share: float) -> Any:
        return static.unscale(jax.grad(lambda q: static.scale(loss(q, x, y, share)))(p))

    bodies = {
        "jmp 2^15 vma": (lambda p, x, y: unscaled(jmp_grad(p, x, y, 1.0)), True),
        "adaloss vma": (lambda p, x, y: unscaled(jax_adaloss.grad(loss)(p, x, y, 1.0)), True),
        "jmp 2^15 pmean": (lambda p, x, y: unscaled(jax.lax.pmean(jmp_grad(p, x, y, devices), "data")),
                           False),
        "adaloss pmean": (lambda p, x, y: unscaled(jax_adaloss.pmean(
            jax_adaloss.grad(loss)(p, x, y, devices), "data")), False),
    }
    one = jax.jit(lambda p: unscaled(jax_adaloss.grad(loss)(p, x, y, 1.0)))(params)
    # the reference, as in the model zoo: the same fp16 forward's gradients at loss x1, unscaled
    ref = jax.jit(lambda p: jax.grad(loss)(p, x, y, 1.0 / factor))(params)
    rows, runs = {}, {}
    for name, (body, vma) in bodies.items():
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                                  check_vma=vma))
        compiled = f.lower(params, xs, ys).compile()
        n, size = all_reduces(compiled.as_text())
        g = compiled(params, xs, ys)
        rows[name] = {"all_reduces": n, "all_reduce_bytes": size, "error_vs_one_device": _error(g, one),
                      "error_vs_loss_x1": _error(g, ref)}
        runs[name] = lambda c=compiled: jax.block_until_ready(c(params, xs, ys))
    for name, ms in _time(runs, repeats, steps).items():
        rows[name]["median_ms"] = ms
    return {"devices": devices, "blocks": blocks, "dim": dim, "seq": seq, "per_device": per_device,
            "factor": factor, "rows": rows}


def _gpt2(dim: int, layers: int, seq: int) -> Any:
    """HF GPT2 at the given width and depth (the zoo's config otherwise), no dropout."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=1000, n_positions=seq, n_embd=dim, n_layer=layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _torch_rank(rank: int, init: str, out: str, repeats: int, steps: int, dim: int, layers: int,
                seq: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import torch_bridge
    from adaloss_zoo import torch_zoo as tz

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ids = tz._tokens(rank, batch=4, seq=seq)
    runs = {}
    for wrap in ("ddp", "fsdp2"):
        for method in ("adaloss", "gradscaler"):
            model = _gpt2(dim, layers, seq)
            if wrap == "ddp":
                model = DistributedDataParallel(model)
            else:
                policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
                for block in model.transformer.h:
                    fully_shard(block, mp_policy=policy)
                fully_shard(model, mp_policy=policy)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            scaler = (torch_bridge.AdaLossScaler(model) if method == "adaloss"
                      else torch.amp.GradScaler("cpu"))

            def step(model: Any = model, opt: Any = opt, scaler: Any = scaler) -> None:
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(input_ids=ids).logits.float()
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            step()
            runs[method if wrap == "ddp" else f"{method} fsdp2"] = step
    ms = _time(runs, repeats, steps)
    if rank == 0:
        params = sum(p.numel() for p in _gpt2(dim, layers, seq).parameters())
        Path(out).write_text(json.dumps({"ms": ms, "params": params}))
    dist.destroy_process_group()


def measure_torch(repeats: int, steps: int, dim: int, layers: int, seq: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ms.json"
        mp.spawn(_torch_rank, args=(f"file://{tmp}/init", str(out), repeats, steps, dim, layers, seq),
                 nprocs=2, join=True)
        got = json.loads(out.read_text())
    ms = got["ms"]
    return {"ranks": 2, "dim": dim, "layers": layers, "seq": seq, "params": got["params"], "median_ms": ms,
            "ratio": ms["adaloss"] / ms["gradscaler"],
            "ratio_fsdp2": ms["adaloss fsdp2"] / ms["gradscaler fsdp2"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--per-device", type=int, default=4)
    ap.add_argument("--factor", type=float, default=1e-3, help="loss multiplier (the study's regime)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--torch-dim", type=int, default=128, help="HF GPT2 width (torch)")
    ap.add_argument("--torch-layers", type=int, default=2, help="HF GPT2 blocks (torch)")
    ap.add_argument("--torch-seq", type=int, default=64, help="tokens per sequence (torch)")
    ap.add_argument("--frameworks", nargs="+", choices=("jax", "torch"), default=["jax", "torch"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {}
    if "jax" in args.frameworks:
        result["jax"] = measure_jax(jax.device_count(), args.blocks, args.dim, args.seq, args.per_device,
                                    args.factor, args.repeats, args.steps)
        print(f"JAX shard_map, {jax.device_count()} CPU devices, {args.blocks} blocks, dim {args.dim}, "
              f"loss x{args.factor:g}")
        print(table(result["jax"]))
    if "torch" in args.frameworks:
        result["torch"] = measure_torch(args.repeats, args.steps, args.torch_dim, args.torch_layers,
                                        args.torch_seq)
        print(torch_line(result["torch"]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **result}, indent=1))
    return result


if __name__ == "__main__":
    main()
