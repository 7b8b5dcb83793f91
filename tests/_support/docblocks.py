"""The fenced code blocks of README.md and docs/*.md, read as test_docs.py runs them (its
docstring gives the conventions the pages follow)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"python", "bash"}

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*(not run|file):\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    not_run: str | None = None  # the reason given
    file: str | None = None  # <!-- file: NAME -->
    output: str | None = None  # the ```text block that follows


def blocks_of(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of one page, in order, with their markers and output blocks."""
    text = path.read_text()
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    found: list[tuple[Block, int, int]] = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        b = Block(name, line, m.group(1), m.group(2))
        mark = _MARK.search(before)
        if mark and mark.group(1) == "not run":
            b.not_run = mark.group(2) or "(no reason given)"
        elif mark:
            b.file = mark.group(2)
        found.append((b, m.start(), m.end()))
    out = []
    for i, (b, start, _end) in enumerate(found):
        if b.lang == "text" and i and found[i - 1][0].lang in RUNNABLE:
            prev, _, prev_end = found[i - 1]
            if text[prev_end:start].strip() == "":
                prev.output = b.code
                continue
        out.append(b)
    return out


def matches(expected: str, printed: str) -> bool:
    """Lines equal, ``...`` in a line matching any text, ``...`` alone any number of lines."""
    parts = []
    for line in expected.rstrip("\n").split("\n"):
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.rstrip().split("...")) + r"[ \t]*\n")
    return re.fullmatch("".join(parts), printed.rstrip("\n") + "\n", re.S) is not None
