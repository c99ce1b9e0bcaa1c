"""The README and the documentation pages: every measured number comes from a generated file
or names its command, the README's code runs, links resolve, no page cites an issue."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

from adaloss_study import doc_blocks, gallery

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: pages written by hand (the results page is written whole by ``adaloss-study --gallery``)
HAND_WRITTEN = [p for p in doc_blocks.pages(ROOT) if p.name != "results.md"]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_GENERATED = re.compile(r"<!-- generated: [\w-]+ -->.*?<!-- end generated -->", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_CODE_SPAN = re.compile(r"`[^`\n]+`")
_COMMAND = re.compile(r"`(python |adaloss-study|pytest|\.venv/bin/)[^`]*`")
#: what reads as a measured figure: a decimal, a percentage, a ratio (1.5×), a count "N of M"
_FIGURE = re.compile(r"\d+(\.\d+)?×|\d+(\.\d+)?\s?%|\b\d+ of \d+\b|\d+\.\d+")
_ISSUE = re.compile(r"(?i)\b(issue|pull request|PR)s?\s*#?\d+|(?<![\w/&])#\d+\b")


def _units(text: str) -> list[str]:
    """Paragraphs, list items and table rows of ``text`` outside code and generated blocks."""
    text = _COMMENT.sub("", _GENERATED.sub("", _FENCE.sub("", text)))
    units: list[list[str]] = [[]]
    for line in text.splitlines():
        if not line.strip() or re.match(r"\s*([-*]|\d+\.)\s|\s*\|", line):
            units.append([])
        if line.strip():
            units[-1].append(line.strip())
    return [" ".join(u) for u in units if u]


def _figures(unit: str) -> list[str]:
    bare = re.sub(r"\]\([^)]*\)", "]", unit)  # link targets
    bare = re.sub(r"arXiv:\d+\.\d+", "", bare)
    if _COMMAND.search(bare):
        return []
    return [m.group(0) for m in _FIGURE.finditer(_CODE_SPAN.sub("", bare))]


def test_every_generated_block_is_what_its_files_give():
    seen = set()
    for page in doc_blocks.pages(ROOT):
        text = page.read_text()
        seen |= {name for name, _ in doc_blocks.blocks(text)}
        assert text.count("<!-- generated:") == len(doc_blocks.blocks(text)), f"{page}: unclosed block"
        assert doc_blocks.stale(text, DOCS) == [], \
            f"{page.relative_to(ROOT)} disagrees with docs/*.json: run `adaloss-study --docs`"
    assert seen == set(doc_blocks.BLOCKS), "every generator is used on a page, every block has one"
    assert "readme-results" in dict(doc_blocks.blocks(README.read_text()))


def test_a_changed_number_in_a_block_is_caught_and_rewritten():
    text = README.read_text()
    body = dict(doc_blocks.blocks(text))["readme-results"]
    number = re.search(r"\d+\.\d{3}", body).group(0)
    edited = text.replace(body, body.replace(number, "9.999", 1))
    assert doc_blocks.stale(edited, DOCS) == ["readme-results"]
    assert doc_blocks.refresh(edited, DOCS) == text
    with pytest.raises(KeyError, match="unknown generated block"):
        doc_blocks.refresh("<!-- generated: nope -->\nx\n<!-- end generated -->", DOCS)


def test_readme_table_reads_the_study_records():
    record = json.loads((DOCS / "default" / "study.json").read_text())
    val = np.mean([r["val_loss"] for r in record["summary"]["adaloss-product"]])
    row = next(line for line in doc_blocks.readme_results(DOCS).splitlines() if "×1e-3" in line
               and "JAX" in line)
    assert row.split("|")[-2].strip() == f"{val:.3f}"


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_figures_outside_generated_blocks_name_their_command(page):
    loose = {u: f for u in _units(page.read_text()) if (f := _figures(u))}
    assert not loose, ("measured figures outside a generated block, with no command named: put them "
                       f"in a block (tools/adaloss_study/doc_blocks.py) or name the command: {loose}")


def test_the_figure_check_can_fail():
    assert _figures("adaloss is 1.49× slower") == ["1.49×"]
    assert _figures("52 of 54 layer-steps") == ["52 of 54"]
    assert _figures("within 5 % of the default") == ["5 %"]
    assert _figures("1.49× slower (`adaloss-study --overhead`)") == []
    assert _figures("T = `1e-3`, a power of two, [arXiv:1910.12385](https://arxiv.org/abs/1910.12385)") == []
    assert _units("a\n\n```\n1.5×\n```\n- b 2.5\n  c\n| 3.5 |") == ["a", "- b 2.5 c", "| 3.5 |"]


@pytest.mark.parametrize("page", doc_blocks.pages(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_cite_no_issue_numbers(page):
    found = [m.group(0) for m in _ISSUE.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)} mentions {found}: say what, not which ticket"


def test_the_issue_check_can_fail():
    assert _ISSUE.search("a fix is open in issue 10") and _ISSUE.search("see #67590")
    assert not _ISSUE.search("[x](results.md#overhead) and 2^15")


def _anchors(md: Path) -> set[str]:
    text = _FENCE.sub("", md.read_text())
    return {gallery.slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", doc_blocks.pages(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = _FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(ROOT)}: broken link {target}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.relative_to(ROOT)}: no heading for {target}"


def test_results_page_is_what_the_gallery_writes(tmp_path, monkeypatch):
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("_build", "*.md", "*.py"))
    monkeypatch.chdir(tmp_path)  # the page names its commands' --out relative to the repository
    path = gallery.write_results(Path("docs"), run=lambda argv: pytest.fail(f"reran {argv}"), reuse=True)
    assert path.read_text() == (DOCS / "results.md").read_text(), \
        "docs/results.md was edited by hand or is stale: `adaloss-study --gallery --out docs --reuse`"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_readme_fits_a_newcomer():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 150
    commands = re.search(r"^```bash\n(.*?)^```", text, re.M | re.S).group(1).splitlines()
    assert len(commands) == 2 and all(c.startswith("python3.11 -m venv .venv") for c in commands)
    snippets = _python_blocks(text)
    steps = [s for s in snippets if not s.startswith("# FSDP2")]
    assert len(steps) == 3 and all(len(s.splitlines()) <= 12 for s in steps)
    recipes = [s.split("\n\n") for s in snippets if s.startswith("# FSDP2")][0]  # each ≤ 10 lines
    assert len(recipes) == 4 and all(len(r.strip().splitlines()) <= 10 for r in recipes)
    first_screen = "\n".join(lines[:60])
    assert "jax_adaloss.value_and_grad" in first_screen and "AdaLossScaler" in first_screen
    assert "](docs/default/underflow.png)" in text


def _readme_snippet(marker: str) -> str:
    return next(s for s in _python_blocks(README.read_text()) if marker in s)


def test_readme_jax_snippet_trains():
    import jax
    import jax.numpy as jnp
    import optax

    import jax_adaloss

    def loss_fn(params, batch):
        x, y = batch
        h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
        logits = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
        return 1e-4 * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    ns = {"jax": jax, "optax": optax, "jax_adaloss": jax_adaloss, "loss_fn": loss_fn}
    exec(_readme_snippet("jax.jit"), ns)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": 0.3 * jax.random.normal(k1, (8, 16)), "w2": 0.3 * jax.random.normal(k2, (16, 4))}
    batch = (jax.random.normal(k3, (32, 8)), jnp.arange(32) % 4)
    opt_state = ns["tx"].init(params)
    losses = []
    for _ in range(3):
        params, opt_state, loss = ns["step"](params, opt_state, batch)
        ns["monitor"](opt_state)
        losses.append(float(loss))
    assert int(optax.tree.get(opt_state, "skipped")) == 0 and losses[-1] < losses[0]


def test_readme_nnx_snippet_trains():
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_adaloss

    model = nnx.Sequential(nnx.Linear(8, 16, dtype=jnp.float16, rngs=nnx.Rngs(0)), nnx.tanh,
                           nnx.Linear(16, 4, dtype=jnp.float16, rngs=nnx.Rngs(1)))
    ns = {"jax": jax, "jnp": jnp, "optax": optax, "nnx": nnx, "jax_adaloss": jax_adaloss, "model": model}
    exec(_readme_snippet("nnx.jit"), ns)
    x, y = jax.random.normal(jax.random.key(2), (32, 8)), jnp.arange(32) % 4
    losses = [float(ns["train_step"](model, ns["optimizer"], x, y)) for _ in range(3)]
    assert int(optax.tree.get(ns["optimizer"].opt_state, "skipped")) == 0 and losses[-1] < losses[0]


def test_readme_torch_snippet_trains():
    torch = pytest.importorskip("torch")

    import torch_bridge

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(32, 8), torch.arange(32) % 4
    loss_fn = lambda logits, y: 1e-4 * torch.nn.functional.cross_entropy(logits.float(), y)
    code = _readme_snippet("AdaLossScaler").replace('"cuda"', '"cpu"')
    assert code.count('"cpu"') == 1, "the snippet's autocast device moved"
    ns = {"torch": torch, "torch_bridge": torch_bridge, "model": model, "opt": opt, "loss_fn": loss_fn,
          "loader": [(x, y)] * 3}
    before = loss_fn(model(x), y).item()
    exec(textwrap.dedent(code), ns)
    assert ns["scaler"].skipped_steps == 0 and loss_fn(model(x), y).item() < before


def test_departures_benchmark_writes_what_the_design_page_reads(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("departures", ROOT / "benchmarks" / "departures.py")
    departures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(departures)
    (tmp_path / "docs").mkdir()
    departures.main(["--framework", "jax", "--models", "equinox-mlp", "--factors", "1e-6",
                     "--json", str(tmp_path / "docs" / "departures.json")])
    table = doc_blocks.departures(tmp_path / "docs")
    row = next(line for line in table.splitlines() if "equinox-mlp" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    n = len(departures.VARIANTS) + len(departures.JAX_VARIANTS)
    assert cells[:3] == ["jax", "equinox-mlp", "1e-06"] and len(cells) == 3 + n
    default, subnormal, fp16_wgrad = float(cells[3]), float(cells[4]), float(cells[-1])
    assert 0 < default < subnormal, "the subnormal u_min must lose gradient the default keeps"
    assert fp16_wgrad != default, "the fp16 weight-gradient stand-in did not take effect"


def test_docs_command_rewrites_a_stale_page(tmp_path, monkeypatch):
    from adaloss_study import cli

    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("_build"))
    text = README.read_text()
    body = dict(doc_blocks.blocks(text))["readme-results"]
    (tmp_path / "README.md").write_text(text.replace(body, "stale"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--docs"]) == 0
    assert (tmp_path / "README.md").read_text() == text
    assert (tmp_path / "docs" / "design.md").read_text() == (DOCS / "design.md").read_text()
