"""Audio decoding: :func:`load_audio` -> :class:`Audio` (``load``), over the audio backends
listed in :mod:`avpipe.decoding.backends` under ``"audio"`` (the GPU FLAC decoder for a FLAC
file on a GPU, soundfile, PyAV). The same GPU FLAC decoder over a window of files,
:mod:`.flac_gpu`, serves :mod:`avpipe.pipeline` and extraction."""

from __future__ import annotations

from ._flac_scan import flac_length_of_path
from ._flac_scan import header_info as flac_header_info
from .load import (
    DAMAGE_POLICIES,
    DURATION_TOLERANCE_S,
    Audio,
    audio_info,
    header_damage,
    load_audio,
    resample,
    shorter_than_declared,
)

__all__ = ["load_audio", "Audio", "resample", "audio_info", "DAMAGE_POLICIES",
           "DURATION_TOLERANCE_S", "shorter_than_declared", "header_damage", "flac_length_of_path",
           "flac_header_info"]
