"""Argument checks shared by every layer: one message shape, ``"<name> must be ..., got <value>"``."""

from __future__ import annotations

import numbers

__all__ = ["pos_int", "check_choice", "check_on_error"]


def pos_int(name: str, value) -> int:
    """``value`` as an int when it is a positive integer (numpy integers too, bools not); else
    ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_choice(name: str, value, choices) -> object:
    """``value`` when it is one of ``choices``; else ``ValueError`` listing them."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def check_on_error(on_error) -> str:
    """``"raise"`` or ``"skip"`` (the ``on_error=`` of every batch API)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error
