"""Which H.264 / HEVC access units are *disposable*: no other picture references them.

A decoder may drop such a packet without changing any other decoded frame (the standards allow
it; it is how players fast-forward). When a request needs only some frames between a keyframe
and its last target, every disposable packet that is not a target is skipped before the decoder
sees it. For x264's default settings about half the packets are disposable, so a sparse request
(a clip with a stride, a few uniform frames) decodes roughly half the frames.

Rules:
* H.264: a picture with ``nal_ref_idc == 0`` in all its slice NAL units (types 1 and 5).
* HEVC: every slice NAL unit has a sub-layer non-reference type (even types below 16:
  TRAIL_N, TSA_N, STSA_N, RADL_N, RASL_N, RSV_VCL_N10/12/14) *and* the stream's highest temporal
  id (a sub-layer non-reference picture can still be referenced by higher sub-layers).
Anything else (other codecs, unparsable data) is never disposable.
"""

from __future__ import annotations

__all__ = ["nal_length_size", "slice_nal_headers", "disposable_flags"]


def nal_length_size(codec: str, extradata: bytes | None) -> int:
    """Bytes of the NAL length prefix (AVCC / hvcC in MP4/MKV), or 0 for Annex B start codes."""
    if not extradata or extradata[0] != 1:
        return 0
    try:
        if codec == "h264" and len(extradata) >= 5:
            return (extradata[4] & 3) + 1
        if codec == "hevc" and len(extradata) >= 22:
            return (extradata[21] & 3) + 1
    except IndexError:
        return 0
    return 0


def _iter_nal_headers(data: bytes, length_size: int, header_bytes: int):
    """The first ``header_bytes`` of every NAL unit in one packet."""
    n = len(data)
    if length_size:
        pos = 0
        while pos + length_size < n:
            size = int.from_bytes(data[pos : pos + length_size], "big")
            start = pos + length_size
            if size <= 0 or start + header_bytes > n:
                return
            yield data[start : start + header_bytes]
            pos = start + size
        return
    # Annex B: NAL units follow 00 00 01 (or 00 00 00 01) start codes
    pos = data.find(b"\x00\x00\x01")
    while pos >= 0:
        start = pos + 3
        if start + header_bytes > n:
            return
        yield data[start : start + header_bytes]
        pos = data.find(b"\x00\x00\x01", start)


def slice_nal_headers(data: bytes, codec: str, length_size: int):
    """(is_reference, temporal_id) of each slice NAL unit in the packet."""
    out = []
    if codec == "h264":
        for h in _iter_nal_headers(data, length_size, 1):
            t = h[0] & 0x1F
            if t in (1, 5):
                out.append(((h[0] >> 5) & 3 != 0, 0))
    elif codec == "hevc":
        for h in _iter_nal_headers(data, length_size, 2):
            t = (h[0] >> 1) & 0x3F
            if t < 32:  # VCL
                tid = (h[1] & 7) - 1
                out.append((not (t < 16 and t % 2 == 0), tid))
    return out


def disposable_flags(packets, codec: str, length_size: int) -> list[bool]:
    """One flag per packet (bytes) in decode order; see the module doc for the rules."""
    if codec not in ("h264", "hevc"):
        return [False] * len(packets)
    headers = [slice_nal_headers(p, codec, length_size) for p in packets]
    max_tid = max((tid for h in headers for _, tid in h), default=0)
    flags = []
    for h in headers:
        flags.append(bool(h) and all((not ref) and tid == max_tid for ref, tid in h))
    return flags


START_CODE = b"\x00\x00\x00\x01"


def parameter_sets_annexb(codec: str, extradata: bytes | None) -> bytes | None:
    """The parameter sets (H.264 SPS/PPS, HEVC VPS/SPS/PPS) of an avcC / hvcC record as Annex B
    NAL units, or None when ``extradata`` is not such a record."""
    if not extradata or extradata[0] != 1:
        return None
    d = bytes(extradata)
    out = []
    try:
        if codec == "h264":
            pos = 5
            for mask in (0x1F, 0xFF):  # SPS count (low 5 bits), then PPS count
                count = d[pos] & mask
                pos += 1
                for _ in range(count):
                    size = int.from_bytes(d[pos : pos + 2], "big")
                    out.append(START_CODE + d[pos + 2 : pos + 2 + size])
                    pos += 2 + size
        elif codec == "hevc":
            pos = 23
            for _ in range(d[22]):
                count = int.from_bytes(d[pos + 1 : pos + 3], "big")
                pos += 3
                for _ in range(count):
                    size = int.from_bytes(d[pos : pos + 2], "big")
                    out.append(START_CODE + d[pos + 2 : pos + 2 + size])
                    pos += 2 + size
        else:
            return None
    except IndexError:
        return None
    if pos > len(d) or not out:
        return None
    return b"".join(out)


def to_annexb(data: bytes, length_size: int) -> bytes | None:
    """One length-prefixed packet (bytes or any bytes-like, e.g. a memoryview of a larger read) as
    Annex B (start codes); None when its prefixes do not add up."""
    n = len(data)
    if length_size == 4:  # same length: overwrite the prefixes
        if n > 4 and int.from_bytes(data[:4], "big") == n - 4:  # one NAL unit (most packets)
            return b"".join((START_CODE, memoryview(data)[4:]))  # one copy
        buf = bytearray(data)
        pos = 0
        while pos + 4 <= n:
            size = int.from_bytes(buf[pos : pos + 4], "big")
            if size <= 0 or pos + 4 + size > n:
                return None
            buf[pos : pos + 4] = START_CODE
            pos += 4 + size
        return bytes(buf) if pos == n else None
    mv = memoryview(data)
    parts, pos = [], 0
    while pos + length_size <= n:
        size = int.from_bytes(mv[pos : pos + length_size], "big")
        if size <= 0 or pos + length_size + size > n:
            return None
        parts += (START_CODE, mv[pos + length_size : pos + length_size + size])
        pos += length_size + size
    return b"".join(parts) if pos == n and parts else None
