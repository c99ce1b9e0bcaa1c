"""The study's tasks: data and model constructors for each framework.

- ``shakespeare``: char-level GPT on the plays (:mod:`adaloss_study.corpus`);
- ``digits``: a small CNN on scikit-learn's 8x8 digits (1797 images; 297 held out).

A task gives training batches, validation batches and model factories; the
loss is the mean cross-entropy of the logits' last axis in both frameworks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Batches = Iterator[tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass
class Task:
    name: str
    train: Callable[[int], Batches]  # seed -> endless training batches
    val: Callable[[int], list[tuple[np.ndarray, np.ndarray]]]  # seed -> validation batches
    flax_model: Callable[[Any, Any, int], Any]  # (cfg, dtype, seed) -> nnx.Module
    torch_model: Callable[[Any], Any]  # cfg -> nn.Module


def shakespeare(cfg: Any) -> Task:
    from adaloss_study import corpus

    text = corpus.load_corpus()
    vocab = len(text.vocab)

    def flax_model(c: Any, dtype: Any, seed: int) -> Any:
        import flax.nnx as nnx

        from adaloss_study.models import CharGPT
        return CharGPT(vocab, c.dim, c.heads, c.layers, c.seq, dtype=dtype, rngs=nnx.Rngs(seed))

    def torch_model(c: Any) -> Any:
        from adaloss_study.torch_models import CharGPT
        return CharGPT(vocab, c.dim, c.heads, c.layers, c.seq)

    def val(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(10_000 + seed)
        it = corpus.batches(text.val, cfg.seq, cfg.batch, rng)
        return [next(it) for _ in range(cfg.eval_batches)]

    return Task("shakespeare", lambda seed: corpus.batches(text.train, cfg.seq, cfg.batch,
                                                           np.random.default_rng(seed)),
                val, flax_model, torch_model)


def digits(cfg: Any) -> Task:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = (images / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)  # NHWC
    y = labels.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    train_idx, val_idx = order[:1500], order[1500:]

    def train(seed: int) -> Batches:
        rng = np.random.default_rng(seed)
        while True:
            idx = rng.choice(train_idx, cfg.batch)
            yield x[idx], y[idx]

    def flax_model(c: Any, dtype: Any, seed: int) -> Any:
        import flax.nnx as nnx

        from adaloss_study.models import DigitsCNN
        return DigitsCNN(dtype=dtype, rngs=nnx.Rngs(seed))

    def torch_model(c: Any) -> Any:
        from adaloss_study.torch_models import DigitsCNN
        return DigitsCNN()

    return Task("digits", train, lambda seed: [(x[val_idx], y[val_idx])], flax_model, torch_model)


TASKS = {"shakespeare": shakespeare, "digits": digits}
