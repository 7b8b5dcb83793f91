"""Noise and impulse-response banks from files: the decoding side of the augmentations.

:class:`avpipe.ops.audio_augment.NoiseBank` and :class:`~avpipe.ops.audio_augment.RirBank` hold
arrays (ops do no I/O); these functions fill them from audio files, a folder, or a NeMo
JSON-lines manifest (``audio_filepath``, relative to the manifest's folder), decoding every
file once at ``sample_rate``, mono.

    bank = noise_bank("noise/manifest.jsonl", sample_rate=16000)
    chain = Chain([AddNoise(bank, snr_db=(5, 20)), ...])
"""

from __future__ import annotations

import os

from ..decoding.audio import load_audio
from ..formats import AUDIO_EXTENSIONS
from ..ops.audio_augment import NoiseBank, RirBank
from .sources import read_manifest

__all__ = ["noise_bank", "rir_bank", "audio_files"]


def audio_files(source) -> list[str]:
    """Paths from a list of paths, a folder (audio files, walked in sorted order) or a NeMo
    JSON-lines manifest (``.json`` / ``.jsonl``)."""
    if isinstance(source, (list, tuple)):
        return [os.fspath(p) for p in source]
    path = os.fspath(source)
    if os.path.isdir(path):
        out = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            out += [
                os.path.join(root, f)
                for f in sorted(files)
                if os.path.splitext(f)[1].lower() in AUDIO_EXTENSIONS
            ]
        if not out:
            raise ValueError(f"source={path!r}: the folder holds no audio files")
        return out
    if path.lower().endswith((".json", ".jsonl")):  # the feeds' manifest reader and rule
        return [it.path for it in read_manifest(path)]
    return [path]


def noise_bank(source, *, sample_rate: int) -> NoiseBank:
    """A :class:`NoiseBank` of every file of ``source`` (see :func:`audio_files`)."""
    return NoiseBank([load_audio(p, sample_rate=sample_rate).samples for p in audio_files(source)])


def rir_bank(source, *, sample_rate: int, align_peak=True, normalize=True) -> RirBank:
    """A :class:`RirBank` of every file of ``source`` (see :func:`audio_files`)."""
    return RirBank(
        [load_audio(p, sample_rate=sample_rate).samples for p in audio_files(source)],
        align_peak=align_peak,
        normalize=normalize,
    )
