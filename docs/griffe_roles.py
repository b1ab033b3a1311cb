"""A griffe extension for the docs site: the docstrings' Sphinx roles (``:func:`name```,
``:class:`~pkg.Name```) read as inline code in the Markdown that mkdocstrings renders."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj|const):`(~?)\.?([^`]+)`")


def _code(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
