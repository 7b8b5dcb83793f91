"""MkDocs hooks for the documentation site (mkdocs.yml: ``hooks``).

avpipe's docstrings name other objects with Sphinx roles (``:func:`log_mel```,
``:class:`~avpipe.pipeline.feed.Feed```); mkdocstrings renders them as the role's text followed
by the code. This hook turns each into plain code, the name shortened after a ``~`` as Sphinx
shows it."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")


def _code(m: re.Match) -> str:
    name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
    return f"<code>{name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_code, html)
