"""``adaloss-study`` end to end on a few steps: table, JSON and plots."""

import json

from adaloss_study import cli


def test_study_runs_every_output(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["--steps", "4", "--measure-every", "2", "--methods", "fp32", "fp16", "dynamic",
            "adaloss-product", "--dim", "32", "--layers", "1", "--seq", "32", "--out", str(out)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    for method in ("fp32", "fp16", "dynamic", "adaloss-product"):
        assert method in table
    record = json.loads((out / "study.json").read_text())
    runs = record["runs"]
    assert len(runs["fp32"]["train_loss"]) == 4 and runs["fp32"]["underflow"] == {}
    assert set(runs["fp16"]["underflow"]) == {"0", "2"}  # measured steps
    assert runs["dynamic"]["scales"]["0"]["global"] == 2.0**16
    assert any(k.startswith("cast:") for k in runs["adaloss-product"]["scales"]["0"])
    for name in ("loss.png", "underflow.png", "scales_adaloss-product.png"):
        assert (out / name).stat().st_size > 10_000
