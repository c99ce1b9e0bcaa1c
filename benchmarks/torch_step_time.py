"""Step time: ``torch_bridge.AdaLossScaler`` vs ``torch.amp.GradScaler``, same model, same process.

    python benchmarks/torch_step_time.py --repeats 5 --steps 20
    python benchmarks/torch_step_time.py --dim 256 --layers 4 --seq 128

The model is the char-level GPT of ``examples/torch_char_gpt.py`` under
``torch.autocast("cpu", dtype=torch.float16)`` with Adam; a step is forward,
backward, (un)scaling, optimizer step and ``update()``. The two scalers are
timed alternately (``repeats`` rounds of ``steps`` steps each, after warm-up);
the ratio of the medians is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import torch_bridge

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from torch_char_gpt import TEXT, CharGPT, batches, make_scaler, train_step  # noqa: E402


def time_mode(model: torch.nn.Module, mode: str, data, steps: int, scaler) -> float:
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(3):
        train_step(model, opt, scaler, *next(data), mode, 1e-4)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, scaler, *next(data), mode, 1e-4)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--update-every", type=int, default=1,
                    help="AdaLossConfig.update_every: recompute the statistical scales every N steps")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = CharGPT(len(set(TEXT)), dim=args.dim, heads=args.heads, layers=args.layers,
                    max_len=args.seq)
    text = TEXT * max(1, (args.seq * 4) // len(TEXT) + 1)
    data = batches(text, args.seq, args.batch, 0)
    config = torch_bridge.AdaLossConfig(update_every=args.update_every)
    scalers = {m: make_scaler(m, model, config) for m in ("fp16+GradScaler", "fp16+adaloss")}
    times: dict[str, list[float]] = {m: [] for m in scalers}
    for _ in range(args.repeats):
        for mode, scaler in scalers.items():
            times[mode].append(time_mode(model, mode, data, args.steps, scaler))
    med = {m: statistics.median(t) for m, t in times.items()}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"CharGPT dim {args.dim}, {args.layers} layers, {n_params / 1e6:.2f}M parameters, "
          f"batch {args.batch} x {args.seq}, update_every {args.update_every}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for m, t in times.items():
        print(f"  {m:<16} median {med[m] * 1e3:8.2f} ms/step  (runs: "
              + ", ".join(f"{x * 1e3:.1f}" for x in t) + ")")
    print(f"  ratio adaloss / GradScaler: {med['fp16+adaloss'] / med['fp16+GradScaler']:.3f}")


if __name__ == "__main__":
    main()
