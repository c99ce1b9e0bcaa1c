"""The coverage table: every weighted layer type users train, probed alone in a tiny model
(``adaloss_zoo.coverage``): per-layer, carried, a warned region, refused, or silent; its fan-in
against a brute-force count; its gradient error at loss x1e-6 against the global baseline's.

    python benchmarks/coverage.py --json docs/coverage.json      # every type (~2 min)
    python benchmarks/coverage.py --framework torch               # print one framework's rows

``adaloss-study --docs`` then rewrites ``docs/coverage.md`` from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import sys
from pathlib import Path

from tqdm import tqdm

from adaloss_zoo import coverage

VERSIONS = ("torch", "jax", "flax", "equinox", "peft", "jmp")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the table here (docs/coverage.json)")
    ap.add_argument("--framework", choices=("torch", "jax"), help="probe one framework only")
    args = ap.parse_args(argv)
    rows = []
    for t in tqdm(coverage.layer_types(args.framework), desc="layer types", file=sys.stderr):
        rows.append(coverage.probe(t))
    data = {"command": "python benchmarks/coverage.py --json docs/coverage.json",
            "date": datetime.date.today().isoformat(),
            "versions": ", ".join(f"{p} {md.version(p)}" for p in VERSIONS), "rows": rows}
    print(coverage.page(data))
    bad = {r["layer"]: coverage.problems(r) for r in rows if coverage.problems(r)}
    if args.json:
        if args.framework:
            sys.exit("--json writes the whole table: leave --framework out")
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    if bad:
        sys.exit(f"rows with problems: {bad}")


if __name__ == "__main__":
    main()
