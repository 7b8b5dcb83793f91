"""The interface an opened video backend implements (PyAV on the CPU, NVDEC on a GPU).

A backend decodes frames of one stream that a packet scan described; it never decides what
happens when it cannot: :class:`~avpipe.decoding.video.VideoDecoder` does, walking the video
list of :mod:`avpipe.decoding.backends`. A backend raises :class:`BackendRefused` when it cannot
decode the stream at all (NVDEC: codec, profile, bit depth, size), and returns the frames of a
request it could not deliver; the front object then asks the PyAV backend for those (or, after
a refusal, the next backend of the list for everything).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..backends import BackendRefused

__all__ = ["VideoBackend", "BackendRefused"]


@runtime_checkable
class VideoBackend(Protocol):
    """Decode requests of one video stream into caller-owned output rows."""

    name: str
    on_gpu: bool  # True: writes cupy rows on the decoder's GPU; False: numpy rows on the host
    damaged: str | None  # why frames were skipped while decoding (damage), else None

    def decode(
        self, targets: Sequence[int], *, output: str, chw: bool, out: Any, slots: Sequence
    ) -> list[int]:
        """Decode the sorted unique display indices ``targets`` into ``out`` ([N, ...], numpy on
        the CPU, cupy on a GPU): ``slots[i]`` lists the rows frame ``targets[i]`` fills. Rows
        are ``[H, W, 3]`` RGB (``[3, H, W]`` with ``chw``) for ``output="rgb"``, ``[H*3/2, W]``
        for ``"nv12"``; never rotated. Returns the targets it did not deliver (their rows are
        left as they were); raises :class:`BackendRefused` when it cannot decode the stream."""
        ...

    def close(self) -> None:
        """Release the backend's decoder and files; the backend is not used afterwards."""
        ...
