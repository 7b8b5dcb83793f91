"""The decode plan: which packets one request decodes. Shared by the PyAV backend and both NVDEC
packet feeds (from the file, from PyNvVideoCodec's demuxer), so they agree on what is skipped.

A request is a sorted list of unique display indices (``targets``). Decoding starts at the
keyframe at or before the first target and runs in decode order. A packet is needed when it is
that keyframe, when other pictures may reference it (not *disposable*, see :mod:`._nal`), or
when it is a target itself; a disposable packet that is not a target is never decoded. The
packet path stops at the last target's packet in decode order (which need not be the last target
in display order); PyAV decodes forward, seeking to a keyframe between targets only where the
packets before it would cost more than the seek, and skips the same disposable packets wherever
it meets them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._scan import StreamScan

__all__ = ["PacketPathError", "DecodePlan", "plan_request", "skippable_pts", "skipped_mask"]


class PacketPathError(RuntimeError):
    """The packet path cannot serve this request; use the SimpleDecoder path instead."""


def _skipped(decode_pts: np.ndarray, disposable: np.ndarray, want) -> np.ndarray:
    """The rule, per packet in decode order: skipped when disposable and not a target (``want``:
    the targets' pts)."""
    return disposable & ~np.isin(decode_pts, np.fromiter(want, np.int64, len(want)))


def skipped_mask(scan: StreamScan, targets) -> np.ndarray | None:
    """Per packet in decode order: disposable and not among the display indices ``targets``
    (the packets :meth:`DecodePlan.needed` leaves out); None when the scan has no packet order."""
    if scan.decode_pts is None or scan.disposable is None:
        return None
    if not scan.disposable.any():
        return np.zeros(len(scan.decode_pts), dtype=bool)
    wanted = {int(scan.pts[t]) for t in targets}
    return _skipped(scan.decode_pts, scan.disposable, wanted)


def skippable_pts(scan: StreamScan, targets) -> frozenset:
    """Pts of the disposable packets that are not among the display indices ``targets``
    (the packets :meth:`DecodePlan.needed` leaves out)."""
    mask = skipped_mask(scan, targets)
    if mask is None or not mask.any():
        return frozenset()
    return frozenset(scan.decode_pts[mask].tolist())


@dataclass(frozen=True)
class DecodePlan:
    """One request's packets in decode order: ``start`` (the keyframe at or before the first
    target), ``last`` (the last target's packet), ``want`` (pts -> display index of each
    target) and :meth:`needed` / :attr:`packets`."""

    start: int
    last: int
    want: dict
    decode_pts: np.ndarray
    skipped: np.ndarray  # per packet in decode order: disposable and not a target

    def needed(self, k: int) -> bool:
        """Whether packet ``k`` (decode order, at or after ``start``) is decoded."""
        return k == self.start or not self.skipped[k]

    @property
    def packets(self) -> list[int]:
        """The packets from ``start`` to ``last`` that are decoded, in decode order."""
        return [k for k in range(self.start, self.last + 1) if self.needed(k)]


def plan_request(scan: StreamScan, targets) -> DecodePlan:
    """The plan for the sorted unique display indices ``targets``; :class:`PacketPathError`
    when the scan has no packet order or does not find the keyframe in it."""
    dpts, disp = scan.decode_pts, scan.disposable
    if dpts is None or disp is None:
        raise PacketPathError("the scan has no packet order")
    want = {int(scan.pts[t]): int(t) for t in targets}
    order = {int(p): k for k, p in enumerate(dpts.tolist())}  # pts -> position in decode order
    start = order.get(int(scan.pts[scan.keyframe_at_or_before(int(targets[0]))]))
    if start is None:
        raise PacketPathError("keyframe not found in the packet order")
    last = max(order[p] for p in want)
    return DecodePlan(start=start, last=last, want=want, decode_pts=dpts,
                      skipped=_skipped(dpts, disp, want))  # fmt: skip
