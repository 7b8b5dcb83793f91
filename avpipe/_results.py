"""The one family of batch results.

Every batch API returns a subclass of :class:`BatchResult` (a frozen dataclass) with

* ``errors``: a tuple of ``(index, DecodeError)``, sorted by index: the items of the batch (or
  of the epoch, for feeds) that failed, each error naming its file;
* ``device``: where the batch's arrays live (``"cpu"``, ``"cuda:N"``).

The rest of the fields are the batch's data (``images``, ``clips``, ``signals`` ...).
"""

from __future__ import annotations

__all__ = ["BatchResult", "sorted_errors"]


class BatchResult:
    """Base of every batch result (see the module's docstring); subclasses are dataclasses that
    declare ``errors`` and ``device``."""

    errors: tuple
    device: str

    @property
    def ok(self) -> bool:
        """True when no item failed."""
        return not self.errors

    def raise_first(self) -> None:
        """Raise the first failed item's :class:`~avpipe.errors.DecodeError`, if any."""
        if self.errors:
            raise self.errors[0][1]


def sorted_errors(errors) -> tuple:
    """``errors`` (pairs ``(index, DecodeError)``) as the sorted tuple a result holds."""
    return tuple(sorted(errors, key=lambda t: t[0]))
