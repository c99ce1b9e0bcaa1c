"""Sphinx configuration for the adaloss documentation.

    sphinx-build -W --keep-going -n -b html docs docs/_build/html

Sphinx + MyST: the pages stay Markdown that reads the same on GitHub (the results page is
written by ``adaloss-study --gallery``), and autodoc imports the real objects, so the API pages
show the signatures and docstrings that ship. ``-W -n`` (what CI runs) turns every warning,
a broken cross-reference or a docstring that does not parse into an error. No extension
reaches the network: intersphinx is not used, and references to other projects' objects in
signatures are left as plain text (``nitpick_ignore_regex`` below).
"""

from __future__ import annotations

import os

# autodoc imports JAX: on the CPU, even where the CUDA plugin (the gpu-program extra) is installed
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "adaloss"
author = "the adaloss developers"
copyright = "2026, the adaloss developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # NamedTuple fields: documented once, by autodoc
default_role = "code"

nitpicky = True
# Objects of Python, numpy, JAX, optax, flax, torch and typing named in signatures: offline,
# without intersphinx, they have no target; our own objects must all resolve.
nitpick_ignore_regex = [
    (r"py:.*", r"(builtins\.)?(int|float|bool|str|bytes|object|type|tuple|list|dict|set|"
               r"frozenset|slice|Ellipsis|NoneType|None|Exception|ValueError|TypeError|"
               r"RuntimeError|NotImplementedError|Warning|UserWarning)"),
    (r"py:.*", r"(typing|collections|collections\.abc|types|dataclasses|enum|contextlib|"
               r"pathlib|numbers|abc)\..*"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|Literal|NamedTuple|Optional|"
               r"Union|TypeVar|Protocol|Self|ClassVar|Generator|Hashable|Path)"),
    (r"py:.*", r"(np|numpy|jax|jnp|jaxlib|optax|flax|nnx|chex|torch|nn|ml_dtypes|array_api_compat)"
               r"(\..*)?"),
    (r"py:.*", r"(.*\.)?_\w+(\..*)?"),  # private helpers (or a private module's) in a public signature
    (r"py:.*", r"(Array|ArrayLike|PyTree|Tensor|Module|DType|dtype|Params|Argnums|StatModel|"
               r"GradFormat|Grads|Scalar)"),
]

html_theme = "sphinx_book_theme"
html_title = "adaloss"
html_theme_options = {"show_toc_level": 2, "navigation_with_keys": False}
html_static_path: list[str] = []
