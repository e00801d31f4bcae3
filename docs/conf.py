"""Sphinx configuration for the dramatiq-unique documentation.

The pages are Markdown, read by myst-parser.  Nothing here reaches the
network: the theme is alabaster, which Sphinx ships with, and there is
no intersphinx.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dramatiq_unique  # noqa: E402

project = "dramatiq-unique"
author = "the dramatiq-unique authors"
copyright = "the dramatiq-unique authors"
release = version = dramatiq_unique.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Anchors for "page.md#a-heading" links, down to third-level headings.
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]

pygments_style = "sphinx"
html_theme = "alabaster"
html_title = f"dramatiq-unique {release}"
html_theme_options = {
    "description": "Unique jobs and per-key locks for Dramatiq",
    "fixed_sidebar": True,
    "page_width": "min(1400px, 96vw)",
    "sidebar_width": "270px",
    "show_powered_by": False,
}
html_sidebars = {"**": ["about.html", "navigation.html", "searchbox.html"]}
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# The API reference (api.md) is generated from the docstrings, which are
# Google style ("Parameters:", "Returns:", "Raises:").
autodoc_member_order = "bysource"
autodoc_typehints = "description"
toc_object_entries = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Warning", "admonition")]
