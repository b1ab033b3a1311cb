"""Griffe extensions for the docs site: the docstrings' Sphinx roles (``:func:`name```,
``:class:`~pkg.Name```) read as inline code in the Markdown that mkdocstrings renders, and a
class's bases leave out private names (a base computed by a private helper, such as the
Hugging Face callback's ``_transformers_callback_base()``, says nothing to a reader)."""

from __future__ import annotations

import re

import griffe

_PRIVATE = re.compile(r"(^|\.)_|\(")  # a private name anywhere in the path, or a call
_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj|const):`(~?)\.?([^`]+)`")


def _code(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)


class PublicBases(griffe.Extension):
    def on_class_instance(self, *, cls: griffe.Class, **kwargs) -> None:
        cls.bases = [base for base in cls.bases if not _PRIVATE.search(str(base))]
