"""How many samples a FLAC file's frames hold, from the headers of its last frames (a read of
the file's tail, no decoding).

STREAMINFO's ``total_samples`` is 0 in a stream written to a pipe (FFmpeg, ``flac -`` ...: the
count was not known when the header was written), and a damaged or hand-edited header can say
fewer or more samples than the frames hold; libsndfile trusts the field (it returns the first
``total_samples`` samples of a file that holds more, and fails on the others). Every frame
header carries its first sample (a frame number times the block size for a fixed block size,
the sample number otherwise) and its block size, protected by a CRC-8: the last frame's first
sample plus its block size is the count the frames hold.
"""

from __future__ import annotations

import os

from ._flac_meta import CRC8, StreamInfo, parse_streaminfo

__all__ = ["FlacLength", "flac_length", "flac_length_of_path", "header_info"]

_TAIL = (1 << 15, 1 << 20)  # bytes of the tail read, then read again if no frame was found

_BLOCK = {1: 192, 2: 576, 3: 1152, 4: 2304, 5: 4608}
_BLOCK.update({k: 256 << (k - 8) for k in range(8, 16)})


def _crc8(b) -> int:
    c = 0
    for x in b:
        c = int(CRC8[c ^ x])
    return c


def _frame_header(buf: bytes, at: int, si: StreamInfo):
    """``(first sample, block size)`` of the frame header at ``buf[at]``, or None when the bytes
    there are no valid header of this stream (sync, reserved bits, codes, CRC-8)."""
    n = len(buf)
    if at + 6 > n or buf[at] != 0xFF or buf[at + 1] not in (0xF8, 0xF9):
        return None
    variable = buf[at + 1] & 1
    bcode, rcode = buf[at + 2] >> 4, buf[at + 2] & 15
    ch, ss, res = buf[at + 3] >> 4, (buf[at + 3] >> 1) & 7, buf[at + 3] & 1
    if bcode == 0 or rcode == 15 or ch > 10 or ss == 3 or res:
        return None
    pos = at + 4
    first = buf[pos]  # the UTF-8-like coded frame / sample number
    if first < 0x80:
        num, more = first, 0
    elif first >= 0xFE:
        if first == 0xFF:
            return None
        num, more = 0, 6
    else:
        more = 0
        while first & (0x40 >> more):
            more += 1
        if more == 0 or more > 5:
            return None
        num = first & (0x3F >> more)
    if pos + 1 + more > n:
        return None
    for k in range(more):
        b = buf[pos + 1 + k]
        if b & 0xC0 != 0x80:
            return None
        num = (num << 6) | (b & 0x3F)
    pos += 1 + more
    if bcode == 6:
        if pos + 1 > n:
            return None
        block, pos = buf[pos] + 1, pos + 1
    elif bcode == 7:
        if pos + 2 > n:
            return None
        block, pos = ((buf[pos] << 8) | buf[pos + 1]) + 1, pos + 2
    else:
        block = _BLOCK[bcode]
    pos += {12: 1, 13: 2, 14: 2}.get(rcode, 0)
    if pos + 1 > n or _crc8(buf[at:pos]) != buf[pos]:
        return None
    nominal = si.max_block or si.min_block
    if variable:
        return num, block
    if nominal <= 0:
        return None
    return num * nominal, block


def _scan(tail: bytes, si: StreamInfo, whole: bool):
    """The count the frames in ``tail`` (the file's last bytes; ``whole``: all of its audio)
    end at: the last frame header whose first sample follows on from an earlier header's
    frame (two headers that chain are no chance match of audio bytes), or a lone header at
    the start of the audio. None when none is found."""
    found = []  # (position, first, block), from the end
    at = len(tail)
    while True:
        at = tail.rfind(b"\xff", 0, at)
        if at < 0:
            break
        h = _frame_header(tail, at, si)
        if h is not None:
            for _pos, first, _block in found:
                if h[0] + h[1] == first:  # this frame ends where that later one starts
                    return max(f + b for _, f, b in found if f >= first)
            found.append((at, h[0], h[1]))
            if len(found) > 64:
                break
    if whole and found and found[-1][0] == 0 and found[-1][1] == 0:
        return found[-1][1] + found[-1][2]  # one frame only: the file's first
    return None


class FlacLength:
    """A FLAC file's STREAMINFO (``info``) and the samples its frames hold (``frames``; None
    when the tail shows no frame header). ``problem``: why the two disagree, or None."""

    def __init__(self, info: StreamInfo, frames: int | None):
        self.info, self.frames = info, frames

    @property
    def streamed(self) -> bool:
        """STREAMINFO gives no count (0): a stream written before its length was known."""
        return self.info.total_samples == 0

    @property
    def total(self) -> int | None:
        """The count to trust: the frames', else STREAMINFO's (None: neither says)."""
        if self.frames is not None:
            return self.frames
        return self.info.total_samples or None

    @property
    def problem(self) -> str | None:
        declared = self.info.total_samples
        if self.streamed or self.frames is None or self.frames == declared:
            return None
        if declared < self.frames:
            return (f"the FLAC header (STREAMINFO) declares {declared} samples, fewer than the "
                    f"{self.frames} its frames hold (a wrong or damaged header)")
        return (f"the FLAC header (STREAMINFO) declares {declared} samples, more than the "
                f"{self.frames} its frames hold (cut short, damaged, or a wrong header)")


def flac_length(f) -> FlacLength | None:
    """:class:`FlacLength` of the FLAC file open as the binary stream ``f`` (seekable), or None
    when it is not FLAC or its metadata does not parse."""
    try:
        f.seek(0)
        head = f.read(1 << 13)
        try:
            si = parse_streaminfo(head)
        except ValueError as e:
            if "cut short" not in str(e) or len(head) < (1 << 13):
                return None
            f.seek(0)
            head = f.read(16 << 20)  # large metadata (pictures)
            si = parse_streaminfo(head)
        size = f.seek(0, os.SEEK_END)
        audio = size - si.audio_offset
        if audio <= 0:
            return FlacLength(si, 0)
        for want in _TAIL:
            k = min(want, audio)
            f.seek(size - k)
            tail = f.read(k)
            got = _scan(tail, si, k == audio)
            if got is not None or k == audio:
                return FlacLength(si, got)
        return FlacLength(si, None)
    except (OSError, ValueError):
        return None


def flac_length_of_path(path) -> FlacLength | None:
    """:func:`flac_length` of a file by path."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            if head != b"fLaC" and head[:3] != b"ID3":
                return None
            return flac_length(f)
    except OSError:
        return None


def header_info(path: str):
    """``(frames, sample_rate, channels)`` from the file's first bytes (FLAC STREAMINFO), or
    ``None`` when that does not say (not FLAC, unknown length, huge metadata)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
        si = parse_streaminfo(head)
    except (OSError, ValueError):
        return None
    total = si.total_samples
    if total <= 0:  # a stream written before its length was known: its frames say
        fl = flac_length_of_path(path)
        total = fl.frames if fl is not None and fl.frames else 0
        if total <= 0:
            return None
    return total, si.sample_rate, si.channels
