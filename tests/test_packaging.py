"""What the ``adaloss`` wheel ships and requires, and the PyTorch front without JAX.

CI also installs ``adaloss[torch]`` alone in a fresh environment and trains there
(``.ci/run``); these are the checks a development install can make.
"""

from __future__ import annotations

import email
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("adaloss", "jax_adaloss", "torch_bridge")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # built from a copy of the checkout without its build outputs: setuptools packs whatever
    # build/ still holds from earlier builds
    src, out = tmp_path_factory.mktemp("src") / "adaloss", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "docs", "*.egg-info", "__pycache__", "runs", "study_out"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True)
    (path,) = out.glob("adaloss-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_ships_the_library_and_nothing_else(wheel):
    names = wheel.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(LIBRARY)
    # every module of the library's packages, subpackages included
    sources = {str(p.relative_to(ROOT)) for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py")}
    assert sources <= set(names), sorted(sources - set(names))


def test_the_core_requires_no_framework_and_the_torch_extra_no_jax(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = email.message_from_bytes(wheel.read(meta)).get_all("Requires-Dist")

    def names(extra: str | None) -> set[str]:
        picked = [r for r in requires if (f'extra == "{extra}"' in r if extra else "extra ==" not in r)]
        return {r.split(";")[0].split(">")[0].split("[")[0].split("=")[0].strip() for r in picked}

    assert names(None) == {"numpy", "ml_dtypes", "array-api-compat"}
    assert names("torch") == {"torch", "scipy"}
    assert {"jax", "optax"} <= names("jax")
    assert "adaloss" in names("study") and "torch" not in names("study")


def test_the_torch_front_trains_where_jax_cannot_be_imported():
    # a finder that refuses JAX and everything built on it, then the PyTorch example
    code = (
        "import importlib.abc, runpy, sys\n"
        "class NoJax(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'chex', 'jmp'):\n"
        "            raise ImportError(f'{name} is blocked: a PyTorch-only install has no JAX')\n"
        "sys.meta_path.insert(0, NoJax())\n"
        "sys.argv = ['torch_minimal.py', '--steps', '12']\n"
        f"runpy.run_path({str(ROOT / 'examples' / 'torch_minimal.py')!r}, run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 skipped; jax imported: False" in out.stdout
