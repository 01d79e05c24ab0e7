"""Sphinx configuration for the jaxscale docs.

Build with warnings as errors (``tests/test_docs.py`` does this)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import jaxscale

project = "jaxscale"
author = "the jaxscale authors"
copyright = "the jaxscale authors"
release = jaxscale.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_autosummary", "Thumbs.db", ".DS_Store"]

# Fail on a broken reference to a page or heading inside these docs.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# -- autodoc / autosummary ----------------------------------------------------
# api.rst lists every object by hand; autosummary only draws the summary tables.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
add_module_names = False
# Show the alias, not the union it expands to.
autodoc_type_aliases = {"jax.typing.ArrayLike": "jax.typing.ArrayLike"}

# -- napoleon (Google-style docstrings) ---------------------------------------
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become ``:ivar:`` fields of the class, not separate
# ``.. attribute::`` objects, which would duplicate the dataclass fields and
# NamedTuple fields that autodoc documents as members.
napoleon_use_ivar = True
napoleon_use_rtype = False
# The field types are in the prose (``f32[]``, "static"); the annotations would
# add private paths such as ``jax.jaxlib._jax.Array``.
napoleon_attr_annotations = False

# -- HTML ---------------------------------------------------------------------
# sphinx-book-theme, as optax and flax use. The build needs no network: no
# repository buttons, no launch buttons, no version switcher, nothing fetched.
html_theme = "sphinx_book_theme"
html_title = f"jaxscale {release}"
html_static_path: list[str] = []
html_theme_options = {
    "home_page_in_toc": True,  # the front page is the first entry of the sidebar
    "show_navbar_depth": 1,  # the captioned sections, each page one level down
    "show_toc_level": 2,  # the right-hand "Contents": sections and subsections
    "use_download_button": True,  # the page's source (.md) or a PDF print
    "use_fullscreen_button": True,
    "use_repository_button": False,
    "use_issues_button": False,
    "use_edit_page_button": False,
    "use_source_button": False,
    "navigation_with_keys": False,
}
