"""Argument checks shared by every layer: one message shape, ``"<name> must be ..., got <value>"``."""

from __future__ import annotations

import math
import numbers

__all__ = ["pos_int", "pos_float", "nonneg_int", "nonneg_float", "check_choice", "check_on_error"]


def pos_int(name: str, value) -> int:
    """``value`` as an int when it is a positive integer (numpy integers too, bools not); else
    ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def pos_float(name: str, value, unit: str = "") -> float:
    """``value`` as a float when it is a finite number > 0 (bools not); else ``ValueError``
    naming ``name`` (``unit``, e.g. ``" seconds"``, goes into the message)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name} must be a positive number{unit}, got {value!r}")
    return float(value)


def nonneg_int(name: str, value) -> int:
    """``value`` as an int when it is an integer >= 0 (bools not); else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def nonneg_float(name: str, value, unit: str = "") -> float:
    """``value`` as a float when it is a finite number >= 0 (bools not); else ``ValueError``."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"{name} must be a non-negative number{unit}, got {value!r}")
    return float(value)


def check_choice(name: str, value, choices) -> object:
    """``value`` when it is one of ``choices``; else ``ValueError`` listing them."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def check_on_error(on_error) -> str:
    """``"raise"`` or ``"skip"`` (the ``on_error=`` of every batch API)."""
    return check_choice("on_error", on_error, ("raise", "skip"))
