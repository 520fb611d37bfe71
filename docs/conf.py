"""Sphinx configuration of torchmp's documentation.

Build (what .ci/run does, warnings are errors):

    pip install '.[docs]'
    sphinx-build -W --keep-going -b html docs docs/_build/html

The API pages are generated from the docstrings of the installed torchmp, so
torchmp must be importable -- installed, or a source tree whose compiled core
was built in place (``python setup.py build_ext --inplace``) put on
``PYTHONPATH``.  This file does not add the source tree to ``sys.path``
itself: a fresh clone has no compiled core, and its ``torchmp/`` would shadow
the installed one.
"""

from __future__ import annotations

import dataclasses

from sphinx.application import Sphinx

import torchmp

project = "torchmp"
author = "The torchmp developers"
copyright = "the torchmp developers"  # noqa: A001 - Sphinx's name
release = torchmp.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "myst_parser",
]

# The Markdown pages (cli.md, compat.md, ...) are read by MyST; the API pages
# are reStructuredText.
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: heading anchors (#the-portable-build) as GitHub makes them, so the
# Markdown pages' links to sections work in both places.
myst_heading_anchors = 3

# autodoc: members in source order; annotations in the signatures, as in
# torch's own API pages; a class's constructor arguments in its signature.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_class_signature = "mixed"
# Defaults as written (``Std.NONE``), not their repr (``<Std.NONE: 0>``, which
# the signature parser cannot read).
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}

html_theme = "alabaster"
html_title = f"torchmp {release}"
html_static_path: list[str] = []


def _public_bases(app: Sphinx, name: str, obj: type, options: object, bases: list[type]) -> None:
    """Show a private base class (``_NativeContext``) as its first public
    ancestor (``PContext``): the private one has no page to link to."""
    for i, base in enumerate(bases):
        if base.__name__.startswith("_"):
            bases[i] = next(b for b in base.__mro__ if not b.__name__.startswith("_"))


def _dataclass_defaults(app: Sphinx, what: str, name: str, obj: object, options: object,
                        signature: str | None, return_annotation: str | None
                        ) -> tuple[str | None, str | None] | None:
    """A dataclass field's ``default_factory`` shows as ``<factory>``, which
    the signature parser cannot read: show what the factory makes (``{}``)."""
    if what != "class" or not signature or not dataclasses.is_dataclass(obj):
        return None
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if f.default_factory is not dataclasses.MISSING:
            signature = signature.replace("<factory>", repr(f.default_factory()), 1)
    return signature, return_annotation


def setup(app: Sphinx) -> None:
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-signature", _dataclass_defaults)
