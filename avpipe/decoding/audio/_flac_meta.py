"""A FLAC file's metadata: STREAMINFO parsed from its first bytes, and the CRC tables of its
frame headers (CRC-8) and frames (CRC-16) (private). The GPU decoder
(:mod:`._flac_cuda`) and the frame scan that counts a file's samples (:mod:`._flac_scan`)
both read them."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["CRC8", "CRC16", "StreamInfo", "parse_streaminfo"]


def _crc_tables():
    """CRC-8 (0x07) table; CRC-16 (0x8005) tables for four bytes at a time: ``crc16[k*256 + x]``
    is the CRC of byte ``x`` followed by ``k`` zero bytes."""
    crc8 = np.zeros(256, np.uint8)
    crc16 = np.zeros((4, 256), np.uint16)
    for i in range(256):
        c = i
        for _ in range(8):
            c = ((c << 1) ^ 0x07) & 0xFF if c & 0x80 else (c << 1) & 0xFF
        crc8[i] = c
        c = i << 8
        for _ in range(8):
            c = ((c << 1) ^ 0x8005) & 0xFFFF if c & 0x8000 else (c << 1) & 0xFFFF
        crc16[0, i] = c
    for k in range(1, 4):
        prev = crc16[k - 1].astype(np.uint32)
        crc16[k] = ((prev << 8) & 0xFFFF) ^ crc16[0][prev >> 8]
    return crc8, crc16.reshape(-1)


CRC8, CRC16 = _crc_tables()


@dataclass(frozen=True)
class StreamInfo:
    """A FLAC file's STREAMINFO, and where its first audio frame starts."""

    sample_rate: int
    channels: int
    bits_per_sample: int
    total_samples: int  # per channel; 0 when the encoder did not know it
    min_block: int
    max_block: int
    audio_offset: int  # bytes from the start of the file


def parse_streaminfo(buf) -> StreamInfo:
    """Parse the metadata of a FLAC file held in ``buf`` (bytes-like). Raises ``ValueError``
    when it is not FLAC or its metadata is cut short."""
    mv = memoryview(buf).cast("B")
    n = len(mv)
    pos = 0
    if n >= 10 and bytes(mv[:3]) == b"ID3":  # an ID3v2 tag in front, as libFLAC tolerates
        size = (mv[6] << 21) | (mv[7] << 14) | (mv[8] << 7) | mv[9]
        pos = 10 + size + (10 if mv[5] & 0x10 else 0)
    if bytes(mv[pos : pos + 4]) != b"fLaC":
        raise ValueError("not a FLAC stream (no 'fLaC' marker)")
    pos += 4
    info = None
    while True:
        if pos + 4 > n:
            raise ValueError("FLAC metadata is cut short")
        head = mv[pos]
        length = (mv[pos + 1] << 16) | (mv[pos + 2] << 8) | mv[pos + 3]
        kind = head & 0x7F
        if kind == 0:
            if length < 34 or pos + 4 + 34 > n:
                raise ValueError("FLAC STREAMINFO is cut short")
            b = bytes(mv[pos + 4 : pos + 4 + 18])
            min_block, max_block = struct.unpack(">HH", b[:4])
            (x,) = struct.unpack(">Q", b[10:18])
            info = dict(
                sample_rate=x >> 44,
                channels=((x >> 41) & 7) + 1,
                bits_per_sample=((x >> 36) & 31) + 1,
                total_samples=x & ((1 << 36) - 1),
                min_block=min_block,
                max_block=max_block,
            )
        elif kind == 127:
            raise ValueError("invalid FLAC metadata block type 127")
        pos += 4 + length
        if head & 0x80:
            break
    if info is None:
        raise ValueError("FLAC stream without STREAMINFO")
    if pos > n:
        raise ValueError("FLAC metadata is cut short")
    return StreamInfo(audio_offset=pos, **info)
