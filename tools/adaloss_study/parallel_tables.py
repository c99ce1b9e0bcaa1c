"""Markdown of ``benchmarks/data_parallel.py``'s results (its JSON), for the console and the results page."""

from __future__ import annotations

from typing import Any

from adaloss_study.commands import benchmark_command

_FLAGS = ("blocks", "dim", "seq", "per_device", "factor", "repeats", "steps", "torch_dim", "torch_layers",
          "torch_seq", "frameworks")


def command(args: dict[str, Any]) -> str:
    """The command line that wrote a JSON with these ``args`` (the flags it recorded)."""
    return benchmark_command("benchmarks/data_parallel.py", [k for k in _FLAGS if k in args], args)


def table(jx: dict[str, Any]) -> str:
    """Markdown: one row per way of computing and reducing the gradient under ``shard_map``."""
    lines = ["| gradient | all-reduces | all-reduce MB | median ms | error vs 1 device | error vs loss ×1 |",
             "|---|---|---|---|---|---|"]
    for name, r in jx["rows"].items():
        lines.append(f"| {name} | {r['all_reduces']} | {r['all_reduce_bytes'] / 1e6:.3f} | "
                     f"{r['median_ms']:.1f} | {r['error_vs_one_device']:.2e} | {r['error_vs_loss_x1']:.2e} |")
    return "\n".join(lines)


def torch_line(t: dict[str, Any]) -> str:
    ms = t["median_ms"]
    model = f"HF GPT2 {t.get('layers', 2)}×{t.get('dim', 128)}"
    if "params" in t:
        model += f" ({t['params'] / 1e6:.2f}M parameters, {t['seq']} tokens × 4 sequences per rank)"
    line = (f"torch, {t['ranks']} gloo ranks, {model}, training step: DDP: AdaLossScaler "
            f"{ms['adaloss']:.1f} ms, GradScaler {ms['gradscaler']:.1f} ms ({t['ratio']:.2f}×)")
    if "ratio_fsdp2" in t:
        line += (f"; FSDP2: AdaLossScaler {ms['adaloss fsdp2']:.1f} ms, GradScaler "
                 f"{ms['gradscaler fsdp2']:.1f} ms ({t['ratio_fsdp2']:.2f}×)")
    return line


def section(result: dict[str, Any]) -> list[str]:
    """The results page's section from the benchmark's JSON."""
    a = result["args"]
    out = ["## Data parallelism: communication and step time", "", f"```\n{command(a)}\n```", ""]
    if "jax" in result:
        j = result["jax"]
        out += [f"JAX: the depth benchmark's LM ({j['blocks']} blocks, dim {j['dim']}, seq {j['seq']}, "
                f"{j['per_device']} sequences per device, loss ×{j['factor']:g}) under `shard_map` on "
                f"{j['devices']} CPU devices. `vma`: `check_vma=True`, the backward sums the replicated "
                "parameters' gradients (adaloss agrees on one scale first); `pmean`: `check_vma=False` "
                "and `jax_adaloss.pmean` / `jax.lax.pmean`. The baseline is `jax.grad` under "
                "`jmp.StaticLossScale(2^15)`. All-reduces counted in the compiled HLO (XLA combines "
                "the scalar ones); errors are the worst per-parameter ‖g − g_ref‖/‖g_ref‖ (attention "
                "key biases, analytically zero, left out).", "", table(j), ""]
    if "torch" in result:
        out += [torch_line(result["torch"]) + ". The traffic is unchanged (the same fp32 buckets or "
                "shards); the gradients are unscaled in the backward, before DDP's or FSDP2's hooks.", ""]
    return out
