"""Sphinx configuration for the exdyna_jax documentation.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import exdyna_jax

project = "exdyna_jax"
author = "exdyna_jax contributors"
copyright = "2026, exdyna_jax contributors"
release = exdyna_jax.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown: `$...$` is not used; fenced code and tables are.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Google-style docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True

# `name` in a docstring is a cross-reference (resolved in the documented
# module, so `exdyna` links to exdyna_jax.exdyna); a name with no page, such
# as a private helper, renders as code. Without this, Sphinx's default role
# would render every `name` as <cite> italics.
default_role = "py:obj"
nitpicky = False

html_theme = "alabaster"
html_title = f"exdyna_jax {release}"
