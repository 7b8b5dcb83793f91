"""The ``avpipe`` command (also ``python -m avpipe``), built with click."""

from .main import main

__all__ = ["main"]
