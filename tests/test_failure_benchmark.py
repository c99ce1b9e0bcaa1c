"""``benchmarks/failures.py`` and its page (``adaloss_study.failure_tables``): the instruments
read hand-made input as they should, and one mechanism reproduces with the real scalers."""

import dataclasses
import json
import logging
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import failures  # noqa: E402

from adaloss_study import failure_tables  # noqa: E402


def test_listening_hears_warnings_and_default_visible_logs_only():
    log = logging.getLogger("some.library")
    with failures._Listening() as heard:
        warnings.warn("loss scale fell to 0.5", UserWarning, stacklevel=1)
        log.warning("OVERFLOW! skipping step")
        log.info("[deepspeed] OVERFLOW! Rank 0 Skipping step")  # below the default level: unseen
    assert heard == ["log some.library: OVERFLOW! skipping step",
                     "warning UserWarning: loss scale fell to 0.5"]
    assert failures._told(heard, None) == "log some.library: OVERFLOW! skipping step"
    assert failures._told(["warning DeprecationWarning: use x instead"], None) is None
    crashed = {"step": 3, "error": "Exception: Current loss scale already at minimum"}
    assert failures._told([], crashed).startswith("raised Exception: Current loss scale")
    assert failures.longest_run([True, True, False, True, True, True, False]) == 3


def _row(method, seed, skipped=0, final=1.0, never=(), told=None, crashed=None, **extra):
    return {"framework": "torch", "case": "c", "method": method, "seed": seed, "steps": 10,
            "skipped": skipped, "longest_skip_run": skipped, "never_moved": list(never), "parameters": 4,
            "initial_loss": 2.0, "final_loss": final, "crashed": crashed, "told": told, "seconds": 0.1,
            **extra}


def test_page_verdicts_and_rows_from_hand_made_runs(tmp_path):
    rows = []
    for seed in (0, 1, 2):
        rows += [_row("fp32", seed, final=1.0), _row("adaloss", seed, final=1.02),
                 _row("gradscaler", seed, skipped=5, final=1.01),  # ties on progress, more skips
                 _row("megatron", seed, final=1.6, never=("w",), told="log x: skipping",
                      crashed={"step": 4, "error": "Exception: scale"}),
                 _row("deepspeed", seed, final=0.9),
                 {"framework": "torch", "case": "c", "method": "fairscale", "seed": seed,
                  "unsupported": "needs a flat nn.Sequential"}]
    rows = failures.with_progress(rows)
    case = dataclasses.asdict(failures.CASES["summed-loss"]) | {"name": "c"}
    data = {"command": "python benchmarks/failures.py", "date": "2026-12-05", "versions": {"torch": "x"},
            "cases": {"c": case}, "methods": {"torch": list(failures.TORCH_METHODS)}, "rows": rows}
    (tmp_path / "failures.json").write_text(json.dumps(data))
    text = failure_tables.page(tmp_path)
    # GradScaler: a tie on the final loss, more skips; Megatron-core raised; DeepSpeed: a lower loss
    assert ("adaloss: better than `torch.amp.GradScaler`, Megatron-core `DynamicGradScaler`; "
            "worse than DeepSpeed `DynamicLossScaler`.") in text
    assert "cannot run: needs a flat nn.Sequential" in text
    assert "| 0 of 10 (raised at step 4 in 3/3) | 0 | 1 of 4 | 1.600 | 1.600 | 0.40 | 3/3 |" in text
    assert "[NVIDIA/apex#289](https://github.com/NVIDIA/apex/issues/289)" in text
    assert "“log x: skipping”" in text
    summary = failure_tables.summary(tmp_path)
    assert summary.splitlines()[2] == ("| A loss summed over tokens: the scale backs off at start-up | "
                                       "GradScaler, Megatron-core | – | DeepSpeed |")
    assert failure_tables.line(tmp_path) == (
        "adaloss beats every other scaler on 0 of 1 mechanisms, ties or beats them all on 0, and loses "
        "to some on 1 (a loss summed over tokens).")


def test_a_weight_gradient_beyond_fp16_at_scale_one_skips_global_scalers_not_adaloss():
    """The benchmark's runs on the ``wgrad-over-range`` mechanism, 20 steps: GradScaler skips
    while its scale falls below 1, jmp (minimum scale 1) skips every step and no parameter
    moves; adaloss skips none and trains (the JAX side of adaloss: tests/test_backoff.py)."""
    pytest.importorskip("jmp")
    case = dataclasses.replace(failures.CASES["wgrad-over-range"], steps=20)
    train, held, vocab = failures.batches(case, 0)
    got = {m: failures.run_torch(case, m, 0, train, held, vocab) for m in ("gradscaler", "adaloss")}
    jmp = failures.run_jax(case, "jmp", 0, train, held, vocab)
    assert got["gradscaler"]["skipped"] >= 10 and got["adaloss"]["skipped"] == 0
    ada = got["adaloss"]
    assert ada["final_loss"] < ada["initial_loss"] and ada["never_moved"] == []
    assert jmp["skipped"] == 20 and len(jmp["never_moved"]) == jmp["parameters"]
    assert jmp["final_loss"] == jmp["initial_loss"]


def test_describe_rewrites_the_cases_text_but_refuses_changed_parameters(tmp_path):
    case = dataclasses.asdict(failures.CASES["two-losses"])
    path = tmp_path / "failures.json"
    path.write_text(json.dumps({"cases": {"two-losses": case | {"note": "old", "title": "old"}}, "rows": []}))
    failures.describe(path)
    got = json.loads(path.read_text())["cases"]["two-losses"]
    assert got["note"] == failures.CASES["two-losses"].note and got["title"] != "old"
    path.write_text(json.dumps({"cases": {"two-losses": case | {"steps": 7}}, "rows": []}))
    with pytest.raises(ValueError, match=r"\['steps'\] differ"):
        failures.describe(path)
