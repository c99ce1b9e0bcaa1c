"""``adaloss-study`` end to end on a few steps: table, JSON and plots."""

import json

import jax
import numpy as np
import optax
import pytest

from adaloss_study import cli


def test_study_runs_every_output(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["--steps", "4", "--measure-every", "2", "--methods", "fp32", "fp16", "dynamic",
            "adaloss", "--dim", "32", "--layers", "1", "--seq", "32", "--out", str(out)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    # the README's names, the threshold, a legend of every method and column, no line over 100
    assert "T = 0.001" in table and max(len(line) for line in table.split("\nwrote:")[0].splitlines()) <= 100
    rows = [line.split()[0] for line in table.splitlines() if line.startswith(("fp32 ", "fp16 ",
                                                                              "dynamic ", "adaloss "))]
    assert rows.count("adaloss") == 2 and rows.count("fp32") == 2  # a row in each of two tables
    assert "\n  adaloss " in table.split("methods:")[1]  # and a legend entry
    assert "adaloss-product" not in table.split("methods:")[0]  # shown under the README's name
    assert "(--methods adaloss-product)" in " ".join(table.split()) and "jmp.DynamicLossScale" in table
    for column in ("under mean/max", "within T", "carried", "flushed", "step time"):
        assert f"  {column}" in table.split("columns:")[1], column
    assert "ms/step" not in table.split("methods:")[0]  # sequential timings are not compared
    for name in ("study.json", "loss.png", "underflow.png", "scales_adaloss-product.png"):
        assert f"{out / name}  " in table, name  # each output named on exit, with what it shows
    record = json.loads((out / "study.json").read_text())
    runs = record["runs"]
    assert len(runs["fp32"]["train_loss"]) == 4 and runs["fp32"]["underflow"] == {}
    assert set(runs["fp16"]["underflow"]) == {"0", "2"}  # measured steps
    assert runs["dynamic"]["scales"]["0"]["global"] == 2.0**16
    # the measurement sees the global scale: 2^16 leaves far less below u_min than none
    under = {m: np.mean([v for step in runs[m]["underflow"].values() for v in step.values()])
             for m in ("fp16", "dynamic")}
    assert under["dynamic"] < 0.5 * under["fp16"]
    assert any(k.startswith("cast:") for k in runs["adaloss-product"]["scales"]["0"])
    limited = runs["adaloss-product"]["limited"]["0"]
    assert isinstance(limited, list) and set(limited) <= set(runs["adaloss-product"]["scales"]["0"])
    for name in ("loss.png", "underflow.png", "scales_adaloss-product.png"):
        assert (out / name).stat().st_size > 10_000


def test_gallery_writes_results_page(tmp_path, monkeypatch):
    from adaloss_study import gallery

    argv = ("--steps", "2", "--measure-every", "1", "--methods", "fp32", "fp16", "--dim", "16",
            "--layers", "1", "--seq", "16")
    timing = ("--overhead", "--task", "digits", "--steps", "1", "--batch", "2", "--repeats", "1")
    monkeypatch.setattr(gallery, "CASES", (gallery.Case("tiny", "Tiny", argv, "Smoke."),))
    monkeypatch.setattr(gallery, "OVERHEAD", (gallery.Case("oh", "Timing", timing, "Smoke."),))
    fp8 = ("--grad-format", "float8_e5m2", "--spike-at", "1", "--steps", "3", "--methods", "fp32", "bf16",
           "adaloss-product", "current", "delayed-16", "--dim", "16", "--layers", "1", "--seq", "16")
    monkeypatch.setattr(gallery, "FP8_CASES", (gallery.Case("tiny8", "Tiny FP8", fp8, "Smoke."),))
    assert cli.main(["--gallery", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "results.md").read_text()
    assert "### Tiny FP8" in page and "| delayed-16 |" in page and "spike loss" in page
    fp8_run = json.loads((tmp_path / "tiny8" / "study.json").read_text())["runs"]["adaloss-product"]
    assert len(fp8_run["fp8_flushed"]) == 3 and (tmp_path / "tiny8" / "fp8_fractions.png").exists()
    assert "## Tiny" in page and "adaloss-study --steps 2" in page
    assert "| fp16 |" in page and "vs fp32" in page
    assert "| [tiny](#tiny) | 1 | " in page  # the overview line
    assert "### Timing" in page and "| adaloss-product |" in page and "vs dynamic" in page
    assert (tmp_path / "tiny" / "loss.png").exists() and (tmp_path / "oh" / "overhead.json").exists()

    def no_rerun(extra):
        raise AssertionError("reran a case")
    again = gallery.write_results(tmp_path, no_rerun, gallery.CASES, reuse=True, overhead=gallery.OVERHEAD,
                                  fp8=gallery.FP8_CASES)
    assert again.read_text() == page


def test_gpu_benchmark_script_runs_its_tiny_preset(tmp_path):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import gpu_step_time

    out = gpu_step_time.main(["--preset", "tiny", "--steps", "1", "--repeats", "1", "--widths", "toy",
                              "--blocks", "1", "--configs", "fp16", "--programs", "gradient",
                              "--json", str(tmp_path / "gpu.json")])
    assert out["ratio"]["adaloss-product"] > 0 and out["parameters"] > 0 and (tmp_path / "gpu.json").exists()
    assert [r["program"] for r in out["programs"]] == ["gradient"]
    assert all(r["median_ms"]["adaloss"] > 0 and r["median_ms"]["baseline"] > 0 for r in out["programs"])


def test_torch_step_benchmark_counts_the_ops_each_scaler_dispatches(tmp_path):
    """AdaLossScaler's step, op by op, dispatches GradScaler's ops and a decision's beyond them,
    more as 0-d tensor ops (a GPU's path) than on host scalars; the table has a row per method
    (the default compiles its decisions after its warm-up: not here, inductor takes seconds)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import torch_step

    methods = ["GradScaler", "AdaLossScaler, op by op", "AdaLossScaler, device math"]
    out = torch_step.main(["--models", "gpt2-2x128", "--repeats", "1", "--steps", "1", "--batch", "2",
                           "--seq", "16", "--methods", *methods, "--run-steps", "3",
                           "--json", str(tmp_path / "step.json")])
    (row,) = out["rows"]
    ops = row["ops"]
    assert ops["GradScaler"] < ops["AdaLossScaler, op by op"] < ops["AdaLossScaler, device math"], ops
    assert row["decisions"] > 0 and torch_step.table(out).count("\n") == 1 + len(methods)
    assert 0 < row["bytes"]["GradScaler"] < row["bytes"]["AdaLossScaler, op by op"], row["bytes"]
    assert [len(row["warmup_ms"][m]) for m in methods] == [3, 3, 3]
    import statistics  # a fresh scaler's first steps, compile included: their mean and median
    assert row["run_mean_ms"] == {m: statistics.mean(row["warmup_ms"][m]) for m in methods}
    assert row["run_median_ms"] == {m: statistics.median(row["warmup_ms"][m]) for m in methods}


def test_the_torch_byte_counter_reads_arguments_writes_results_and_counts_no_view():
    """``torch_step.OpCounter`` on hand-made ops: an add reads two tensors and writes one, an
    in-place add reads two and writes one, a view moves nothing, a factory writes its result."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import torch
    import torch_step

    a, b = torch.ones(256, 4), torch.ones(256, 4)
    n = a.numel() * a.element_size()
    for fn, moved in ((lambda: a + b, 3 * n), (lambda: a.add_(b), 3 * n), (lambda: a.view(4, 256), 0),
                      (lambda: a.t(), 0), (lambda: torch.zeros(256, 4, dtype=torch.float16), n // 2)):
        with torch_step.OpCounter() as c:
            fn()
        assert c.bytes == moved, (c.ops, c.bytes, moved)


def test_study_torch_framework(tmp_path, capsys):
    out = tmp_path / "torch"
    argv = ["--framework", "torch", "--steps", "3", "--measure-every", "2", "--methods", "fp32", "fp16",
            "static", "dynamic", "adaloss-product", "--dim", "32", "--layers", "1", "--seq", "32",
            "--no-plots", "--out", str(out)]
    assert cli.main(argv) == 0
    runs = json.loads((out / "study.json").read_text())["runs"]
    assert runs["dynamic"]["scales"]["0"]["global"] == 2.0**16
    # the measurement sees the global scale: 2^16 leaves far less below u_min than none
    under = {m: np.mean([v for step in runs[m]["underflow"].values() for v in step.values()])
             for m in ("fp16", "dynamic")}
    assert under["dynamic"] < 0.5 * under["fp16"]
    assert runs["static"]["scales"]["0"]["global"] == 2.0**15
    assert "cast:0" in runs["adaloss-product"]["scales"]["0"]
    assert set(runs["adaloss-product"]["underflow"]) == {"0", "2"}
    assert set(runs["adaloss-product"]["limited"]["0"]) <= set(runs["adaloss-product"]["scales"]["0"])


def test_study_torch_fp8_against_torchao(tmp_path, capsys):
    """``--framework torch --grad-format float8_e5m2``: the bridge's fp8 casts report their
    fractions every step, torchao's float8 training (``emulate=False``) and the converted layers
    (``adaloss-e2e``: every GEMM ``_scaled_mm``) train beside it, a spike
    runs in torch too; methods one framework lacks are refused before anything runs."""
    pytest.importorskip("torchao")
    out = tmp_path / "torch8"
    argv = ["--framework", "torch", "--grad-format", "float8_e5m2", "--steps", "3", "--spike-at", "1",
            "--methods", "adaloss-product", "adaloss-e2e", "torchao-tensorwise",
            "--dim", "32", "--layers", "1", "--seq",
            "32", "--no-plots", "--out", str(out)]
    assert cli.main(argv) == 0
    record = json.loads((out / "study.json").read_text())
    ada = record["runs"]["adaloss-product"]
    assert set(ada["fp8_flushed"]) == {"0", "1", "2"} and ada["fp8_saturated"]["1"]
    assert set(record["runs"]["adaloss-e2e"]["fp8_flushed"]) == {"0", "1", "2"}
    assert np.isnan(record["summary"]["torchao-tensorwise"][0]["flushed_max"])  # it reports none
    assert "spike_loss" in record["summary"]["torchao-tensorwise"][0]
    with pytest.raises(SystemExit, match="delayed-16.*jax only"):
        cli.main(["--framework", "torch", "--grad-format", "float8_e5m2", "--methods", "delayed-16",
                  "--out", str(out)])


def test_study_digits_task_both_frameworks(tmp_path):
    for framework in ("jax", "torch"):
        out = tmp_path / framework
        argv = ["--task", "digits", "--framework", framework, "--steps", "3", "--batch", "8",
                "--measure-every", "2", "--methods", "fp32", "adaloss-gradient", "--no-plots",
                "--out", str(out)]
        assert cli.main(argv) == 0
        runs = json.loads((out / "study.json").read_text())["runs"]
        assert len(runs["adaloss-gradient"]["train_loss"]) == 3
        assert runs["adaloss-gradient"]["underflow"]  # measured at steps 0 and 2


def test_which_model_section_is_computed_from_the_records():
    from adaloss_study import gallery

    def summary(product, output, gradient):
        return {m: [{"val_loss": 2.0, "underflow_mean": u}] for m, u in
                zip(gallery.ADALOSS, (product, output, gradient))}
    records = {"a": {"summary": summary(1e-4, 2e-4, 3e-4)}, "b": {"summary": summary(5e-4, 1e-4, 6e-4)},
               "c": {"summary": summary(1e-5, 1e-5, 2e-5)}, "skip": {"summary": {"fp32": []}}}
    text = "\n".join(gallery._which_model(records))
    assert "adaloss-product in 1, adaloss-output in 1, adaloss-gradient in 0 of 3 cases; tied in 1" in text
    assert "Default: `product`" in text


def test_table_reports_mean_and_std_over_seeds():
    runs = [{"train_loss": 1.0, "val_loss": v, "val_ppl": 3.0, "skipped": 0, "underflow_mean": 1e-3,
             "underflow_max": 2e-3, "within_T": 0.5, "carried_mean": 3e-3,
             "flushed_max": 1e-4, "step_ms": 10.0} for v in (2.0, 2.5)]
    lines = cli._table({"fp32": runs}).splitlines()
    assert lines[0] == "training" and "2.2500±0.2500" in lines[3]
    assert len(lines[1]) == len(lines[3])  # columns aligned
    under = lines[lines.index("per-layer underflow") + 3]
    assert "1.00e-03±0e+00" in under and max(map(len, lines)) <= 100


def test_threshold_summary_separates_held_back_scales_from_model_misses():
    from adaloss_study import gallery

    record = {"config": {"adaloss": {"threshold": 1e-3}},
              "runs": {"adaloss-product": {
                  "underflow": {"0": {"a": 0.0, "b": 0.5, "c": 0.01}, "50": {"a": 2e-3, "b": 1e-4, "c": 0.0}},
                  "predicted": {"0": {"a": 0.0, "b": 0.4, "c": 1e-4}, "50": {"a": 1e-3, "b": 0.0, "c": 0.0}},
                  "carried": {"0": {"b": 0.6}, "50": {"b": 0.2}},
                  "scales": {"0": {"a": 1.0, "b": 2.0, "c": 4.0, "cast:0": 8.0},
                             "50": {"a": 1.0, "b": 2.0, "c": 4.0, "cast:0": 8.0}},
                  "limited": {"0": ["b", "cast:0"], "50": []}}}}
    page = "\n".join(gallery._threshold_summary({"case": record}))
    # b@0: held back (predicted 0.4); a@50 and c@0: misses (predicted <= T); 2 of 8 decisions limited
    assert "| case | 6 | 3 | 1 | 2 | 2 / 8 |" in page
    assert "`a`, `c`" in page
    # with the layers' held flags recorded: held back where a capped decision set the scale
    record["runs"]["adaloss-product"]["held"] = {"0": ["c"], "50": []}
    page = "\n".join(gallery._threshold_summary({"case": record}))
    assert "| case | 6 | 3 | 1 | 2 | 2 / 8 |" in page and "`a`, `b`" in page
    detail = "\n".join(gallery._against_threshold(record))
    # measured mean and max, predicted mean, carried mean (none recorded for c), steps above T
    assert "| b | 2.50e-01 | 5.00e-01 | 2.00e-01 | 4.00e-01 | 1 / 2 |" in detail
    assert "| c | 5.00e-03 | 1.00e-02 | 5.00e-05 | – | 1 / 2 |" in detail


def test_overhead_mode_times_methods_alternately(tmp_path, capsys):
    for framework in ("jax", "torch"):
        out = tmp_path / framework
        argv = ["--overhead", "--framework", framework, "--task", "digits", "--steps", "2", "--batch", "4",
                "--repeats", "2", "--out", str(out)]
        assert cli.main(argv) == 0
        result = json.loads((out / "overhead.json").read_text())
        assert set(result["ms_per_step"]) == {"fp16", "dynamic", "adaloss-product"}
        assert all(len(v) == 2 and min(v) > 0 for v in result["ms_per_step"].values())
        assert result["ratio"]["dynamic"] == 1.0 and result["ratio"]["adaloss-product"] > 0
        assert "adaloss-product" in capsys.readouterr().out


def test_adam_eps_follows_the_loss_factor_so_fp32_ignores_it(tmp_path):
    """With ε = adam_eps × loss_factor, Adam sees the same problem at ×1 and ×1e-8: the fp32
    reference trains the same (a fixed ε = 1e-8 would dominate gradients of ~1e-10)."""
    losses = {}
    for factor in ("1", "1e-8"):
        out = tmp_path / factor
        argv = ["--steps", "6", "--measure-every", "0", "--methods", "fp32", "--dim", "16", "--layers",
                "1", "--seq", "16", "--loss-factor", factor, "--no-plots", "--out", str(out)]
        assert cli.main(argv) == 0
        losses[factor] = json.loads((out / "study.json").read_text())["runs"]["fp32"]["train_loss"]
    assert losses["1"][-1] < losses["1"][0]  # it trains
    assert losses["1e-8"] == pytest.approx(losses["1"], rel=1e-3)


def test_fp32_cold_applies_no_gradient_at_step_0():
    """``fp32-cold`` (delayed scaling's cold start, without the fp8): step 0 leaves the weights as
    they are and counts in Adam; step 1 trains."""
    from adaloss_study import jax_runner
    args = cli._parser().parse_args(["--dim", "16", "--layers", "1", "--seq", "16"])
    base = cli._run_config(args)
    task = cli.TASKS[args.task](base)
    t = jax_runner.Trainer("fp32-cold", base, task.flax_model)
    data = task.train(0)
    before = t.params
    t.step(*next(data))
    jax.tree.map(np.testing.assert_array_equal, t.params, before)
    assert int(optax.tree.get(t.state[0], "count")) == 1
    t.step(*next(data))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(t.params), jax.tree.leaves(before)))


def test_ablation_methods(tmp_path, capsys):
    """cast-only: layers apply no statistical scale (≤ 1), the loss cast does; largest-safe:
    the caps decide; dynamic-grow: GradScaler's rule with the growth interval scaled down."""
    out = tmp_path / "ablations"
    argv = ["--steps", "4", "--measure-every", "2", "--methods", "dynamic-grow", "cast-only",
            "largest-safe", "adaloss-product", "--growth-interval", "1", "--dim", "16", "--layers", "1",
            "--seq", "16", "--no-plots", "--out", str(out)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "within T" in table and "carried" in table and "flushed" in table
    record = json.loads((out / "study.json").read_text())
    runs = record["runs"]
    grow = runs["dynamic-grow"]["scales"]
    assert grow["3"]["global"] > grow["0"]["global"] > 2.0**16  # from 2^16, doubled every clean step
    # the recorded loss is unscaled by the scale its step used, not by the doubled one
    recorded = runs["dynamic-grow"]["train_loss"]
    assert recorded == pytest.approx(runs["adaloss-product"]["train_loss"], rel=1e-2)
    cast_only = runs["cast-only"]["scales"]["0"]
    assert max(v for k, v in cast_only.items() if not k.startswith("cast:")) <= 1.0
    assert max(v for k, v in cast_only.items() if k.startswith("cast:")) > 1.0
    # the first decision (the loss cast, the largest): largest-safe takes at least the statistical
    # scale, and its layers then lower it where the caps say so
    ada, safe = runs["adaloss-product"]["scales"]["0"], runs["largest-safe"]["scales"]["0"]
    loss_cast = max((k for k in ada if k.startswith("cast:")), key=ada.get)
    assert safe[loss_cast] >= ada[loss_cast] > 1.0
    assert min(safe.values()) < 1.0
    for rows in record["summary"].values():
        assert 0.0 <= rows[0]["within_T"] <= 1.0
        assert 0.0 <= rows[0]["flushed_max"] <= 1.0 and 0.0 <= rows[0]["carried_mean"] <= 1.0
    for run in runs.values():  # flushed entries are a subset of those held below u_min as carried
        for step, flushed in run["flushed"].items():
            assert all(v <= run["carried"][step][k] for k, v in flushed.items())


def test_depth_benchmark_runs_every_layout(tmp_path, capsys):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import depth

    rows = depth.main(["--blocks", "1", "--dim", "16", "--heads", "2", "--seq", "8", "--batch", "2",
                       "--vocab", "32", "--repeats", "1", "--steps", "1", "--json", str(tmp_path / "d.json")])
    layouts = {r["layout"]: r for r in rows}
    assert set(layouts) == {"unrolled", "scanned", "torch"}
    for layout in ("unrolled", "scanned"):
        ratio = layouts[layout]["ratio"]
        assert all(np.isfinite(v) and v > 0 for v in ratio.values()), ratio
        assert {"compile", "hlo_ops", "bytes", "train_step"} <= set(ratio)
    assert layouts["torch"]["ratio"]["train_step"] > 0
    printed = capsys.readouterr().out
    assert "| 1 | scanned |" in printed and (tmp_path / "d.json").exists()
    from adaloss_study.depth_tables import section
    page = "\n".join(section(json.loads((tmp_path / "d.json").read_text())))
    assert page.startswith("## Depth") and "| 1 | scanned |" in page and "AdaLossScaler" in page


def test_cost_breakdown_removes_one_part_per_variant(tmp_path, capsys):
    """benchmarks/cost_breakdown.py: each variant's patches take effect (the optimised HLO changes
    with every part taken out and shrinks from the decisions on, so a renamed internal cannot
    leave a variant measuring adaloss; the statistics' stand-in, one element read per tensor,
    is no smaller in instructions than the reductions it replaces)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import cost_breakdown

    rows = cost_breakdown.main(["--blocks", "1", "--layouts", "unrolled", "--dim", "16", "--heads", "2",
                                "--seq", "8", "--batch", "2", "--vocab", "32", "--compiles", "1",
                                "--repeats", "1", "--steps", "1", "--json", str(tmp_path / "c.json")])
    (row,) = rows
    names = [v["name"] for v in row["variants"]]
    assert names == ["jax"] + [name for name, _ in cost_breakdown.ABLATIONS]
    ops = [v["hlo_ops"] for v in row["variants"][1:-1]]  # adaloss .. "- rescales"
    assert ops[0] != ops[1] and all(a > b for a, b in zip(ops[1:], ops[2:])), dict(zip(names[1:], ops))
    assert all(v["compile_s"] > 0 and v["step_ms"] > 0 and v["bytes_accessed"] > 0 for v in row["variants"])
    from adaloss_study.cost_tables import section
    page = "\n".join(section(json.loads((tmp_path / "c.json").read_text())))
    assert page.startswith("## Where the JAX overhead goes") and "| 1 | unrolled | - decisions |" in page
    assert "--compiles 1" in page and "| 1 | unrolled | - decisions |" in capsys.readouterr().out


def test_data_parallel_benchmark_counts_the_all_reduces(tmp_path):
    """benchmarks/data_parallel.py on 4 CPU devices (its own process: the device count is set
    before JAX starts), tiny sizes, JAX only (test_torch_ddp runs DDP)."""
    import os
    import subprocess
    import sys
    out = tmp_path / "dp.json"
    here = os.path.dirname(__file__)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(here, "..", "benchmarks", "data_parallel.py"),
                           "--blocks", "1", "--dim", "16", "--seq", "8", "--per-device", "1",
                           "--repeats", "1", "--steps", "1", "--frameworks", "jax", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["jax"]["rows"]
    assert result["jax"]["devices"] == 4 and set(rows) == {"jmp 2^15 vma", "adaloss vma", "jmp 2^15 pmean",
                                                             "adaloss pmean"}
    assert all(r["all_reduces"] >= 1 and r["all_reduce_bytes"] > 0 for r in rows.values())
    assert rows["adaloss pmean"]["error_vs_one_device"] < 1e-2
    from adaloss_study.parallel_tables import section
    page = "\n".join(section(result))
    assert page.startswith("## Data parallelism") and "| adaloss vma |" in page


def test_data_parallel_torch_line_reads_old_and_new_records():
    """The results page's torch line: DDP alone (records before FSDP2 was measured) and DDP with
    FSDP2 and the model's size."""
    from adaloss_study.parallel_tables import command, torch_line
    old = {"ranks": 2, "median_ms": {"adaloss": 208.6, "gradscaler": 176.4}, "ratio": 1.18}
    assert "HF GPT2 2×128" in torch_line(old) and "FSDP2" not in torch_line(old)
    new = {**old, "dim": 256, "layers": 4, "seq": 128, "params": 3.4e6, "ratio_fsdp2": 1.05,
           "median_ms": {"adaloss": 208.6, "gradscaler": 176.4, "adaloss fsdp2": 210.0,
                         "gradscaler fsdp2": 200.0}}
    line = torch_line(new)
    assert "HF GPT2 4×256 (3.40M parameters" in line and "FSDP2: AdaLossScaler 210.0 ms" in line
    assert "(1.05×)" in line
    args = {"blocks": 2, "dim": 128, "seq": 64, "per_device": 4, "factor": 1e-3, "repeats": 5, "steps": 3,
            "frameworks": ["torch"], "json": "x.json"}
    assert "--torch-dim" not in command(args)
    assert "--torch-dim 256 --torch-layers 4" in command({**args, "torch_dim": 256, "torch_layers": 4,
                                                          "torch_seq": 128})


def test_scale_heatmap_rows_have_their_own_log_range_and_casts_say_what_they_cast(tmp_path):
    from adaloss_study import plots
    from adaloss_study.jax_runner import RunResult
    scales = {0: {"params/a": 2.0**10, "cast:0": 2.0**28}, 50: {"params/a": 2.0**12, "cast:0": 2.0**28}}
    grid = np.log2(np.array([[scales[s][k] for s in (0, 50)] for k in ("params/a", "cast:0")]))
    shown, low, high = plots.per_row(np.vstack([grid, [[np.nan, 3.0]]]))
    # a layer moving over 2 binades spans the colours; a cast at 2^28 does not flatten it
    np.testing.assert_array_equal(shown[:2], [[0.0, 1.0], [0.0, 0.0]])
    assert list(low) == [10, 28, 3] and list(high) == [12, 28, 3] and np.isnan(shown[2, 0])
    casts = {"cast:0": "float16 → float32 (16, 64, 65) at /somewhere/jax_runner.py:212:17 (loss)"}
    assert plots.row_label("cast:0", casts) == "cast:0 f16→f32 (16, 64, 65) jax_runner.py:212 loss"
    torch_site = {"cast:1": "float16 → float32 (8, 16, 40) at ToCopyBackward0"}
    assert plots.row_label("cast:1", torch_site) == "cast:1 f16→f32 (8, 16, 40) at ToCopyBackward0"
    assert plots.row_label("params/a", casts) == "a"
    result = RunResult("adaloss-product", scales=scales, casts=casts)
    assert plots.scale_heatmap(result, tmp_path / "s.png").stat().st_size > 10_000
