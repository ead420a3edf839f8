"""Sphinx configuration: `sphinx-build -W --keep-going -b html docs docs/_build/html`.

Pages are MyST Markdown; the notebooks (../notebooks, linked here as notebooks/) are rendered
by myst-nb from their committed outputs, never re-executed (tests/test_notebooks.py executes
them); the API reference is autodoc + autosummary over the docstrings (Google style, napoleon).
tests/test_docs.py builds the site with warnings as errors.
"""

from __future__ import annotations

import importlib.metadata
import re

project = "loss_scaling"
author = "loss_scaling contributors"
copyright = "2026, loss_scaling contributors"  # noqa: A001 - Sphinx's name
release = importlib.metadata.version("loss-scaling")

extensions = [
    "myst_nb",  # MyST Markdown pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "_*.md"]  # _x.md: included by a page
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# Notebooks: rendered as committed (already executed by tests/test_notebooks.py).
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# API reference: no generated stub files (nothing is written into docs/ by a build).
autosummary_generate = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = "loss_scaling"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
# No network access at build time.
html_permalinks_icon = "#"


# The notebooks live in ../notebooks (docs/notebooks is a link to it, so Sphinx finds them).
# Pages link to them as `../notebooks/NAME.ipynb`, which works on GitHub; Sphinx resolves
# links through the link to outside docs/, so turn those links into `{doc}` references.
_NOTEBOOK_LINK = re.compile(r"\[([^\]]+)\]\(\.\./notebooks/([\w.-]+)\.ipynb\)")


def _link_notebooks(app, docname, source):
    source[0] = _NOTEBOOK_LINK.sub(r"{doc}`\1 <notebooks/\2>`", source[0])


def setup(app):
    app.connect("source-read", _link_notebooks)
