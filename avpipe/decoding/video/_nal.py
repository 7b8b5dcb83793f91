"""The H.264 / HEVC bitstream: NAL units, parameter sets, and which access units are
*disposable* (no other picture references them).

Parameter sets (:func:`h264_sps`, :func:`hevc_sps`, the ``avcC`` / ``hvcC`` records) are read
as FFmpeg's decoders export their fields (dimensions, cropping, chroma format, bit depth, VUI
colour and aspect ratio), for the MP4 reader (``_mp4.py``); anything this parser does not read
raises :class:`BitstreamError`.

Disposable access units: a decoder may drop such a packet without changing any other decoded frame (the standards allow
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

import numpy as np

__all__ = [
    "BitstreamError",
    "avcc_sets",
    "disposable_flags",
    "h264_pps_refs",
    "h264_sps",
    "hevc_sps",
    "hvcc_nals",
    "hvcc_sps",
    "is_i_slice",
    "nal_length_size",
    "parameter_sets_annexb",
    "pixel_props",
    "sei_has_recovery_point",
    "slice_nal_headers",
    "to_annexb",
]


class BitstreamError(Exception):
    """A parameter set or NAL unit this parser does not read (malformed, cut short, or a feature
    it leaves to FFmpeg)."""


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


# --------------------------------------------------------------------------------------------
# bit reader and parameter sets (SPS / PPS / VUI fields as FFmpeg's H.264 and HEVC decoders
# export them), and the slice / SEI fields the MP4 reader's key flags need
# --------------------------------------------------------------------------------------------


def _unescape(nal: bytes) -> bytes:
    return nal.replace(b"\x00\x00\x03", b"\x00\x00") if b"\x00\x00\x03" in nal else nal


class _Bits:
    __slots__ = ("v", "n", "p")

    def __init__(self, data: bytes):
        self.v = int.from_bytes(data, "big")
        self.n = len(data) * 8
        self.p = 0

    def u(self, k: int) -> int:
        if k == 0:
            return 0
        if self.p + k > self.n:
            raise BitstreamError("parameter set ends early")
        self.p += k
        return (self.v >> (self.n - self.p)) & ((1 << k) - 1)

    def ue(self) -> int:
        z = 0
        while self.u(1) == 0:
            z += 1
            if z > 31:
                raise BitstreamError("bad exp-Golomb code")
        return (1 << z) - 1 + self.u(z)

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k & 1 else -(k // 2)


_SAR = [(0, 1), (1, 1), (12, 11), (10, 11), (16, 11), (40, 33), (24, 11), (20, 11), (32, 11),
        (80, 33), (18, 11), (15, 11), (64, 33), (160, 99), (4, 3), (3, 2), (2, 1)]


def _vui_common(b: _Bits, sps: dict) -> None:
    if b.u(1):  # aspect_ratio_info_present_flag
        idc = b.u(8)
        if idc == 255:
            sps["sar"] = (b.u(16), b.u(16))
        elif idc < len(_SAR):
            sps["sar"] = _SAR[idc]
        else:
            raise BitstreamError("reserved aspect_ratio_idc")
    if b.u(1):  # overscan_info_present_flag
        b.u(1)
    if b.u(1):  # video_signal_type_present_flag
        b.u(3)
        sps["full_range"] = b.u(1)
        if b.u(1):  # colour_description_present_flag
            b.u(8)
            b.u(8)
            sps["matrix"] = b.u(8)


def h264_sps(nal: bytes) -> dict:
    b = _Bits(_unescape(nal[1:]))
    profile = b.u(8)
    b.u(16)
    b.ue()
    sps = {"chroma": 1, "depth": 8, "sar": (0, 1)}
    if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
        sps["chroma"] = b.ue()
        if sps["chroma"] == 3:
            b.u(1)
        sps["depth"] = b.ue() + 8
        b.ue()
        b.u(1)
        if b.u(1):  # seq_scaling_matrix_present_flag
            for i in range(8 if sps["chroma"] != 3 else 12):
                if b.u(1):
                    last = nxt = 8
                    for _ in range(16 if i < 6 else 64):
                        if nxt:
                            nxt = (last + b.se()) % 256
                        last = nxt or last
    if sps["chroma"] > 3:
        raise BitstreamError("bad chroma_format_idc")
    b.ue()  # log2_max_frame_num_minus4
    poc_type = b.ue()
    if poc_type == 0:
        b.ue()
    elif poc_type == 1:
        b.u(1)
        b.se()
        b.se()
        for _ in range(min(b.ue(), 255)):
            b.se()
    sps["ref_frames"] = b.ue()
    b.u(1)
    w_mbs = b.ue() + 1
    h_units = b.ue() + 1
    frame_mbs_only = b.u(1)
    if not frame_mbs_only:
        b.u(1)
    b.u(1)
    crop = [0, 0, 0, 0]
    if b.u(1):
        crop = [b.ue(), b.ue(), b.ue(), b.ue()]
    c = sps["chroma"]
    cx = 1 if c in (0, 3) else 2
    cy = (1 if c in (0, 2, 3) else 2) * (2 - frame_mbs_only)
    sps["width"] = w_mbs * 16 - cx * (crop[0] + crop[1])
    sps["height"] = (2 - frame_mbs_only) * h_units * 16 - cy * (crop[2] + crop[3])
    if b.u(1):  # vui_parameters_present_flag
        _vui_common(b, sps)
    return sps


def _hevc_ptl(b: _Bits, max_sub: int) -> None:
    b.u(32)
    b.u(32)
    b.u(32)  # general profile/tier/level: 96 bits
    prof = []
    for _ in range(max_sub):
        prof.append((b.u(1), b.u(1)))
    if max_sub > 0:
        for _ in range(max_sub, 8):
            b.u(2)
    for p, lv in prof:
        if p:
            b.u(32)
            b.u(32)
            b.u(24)
        if lv:
            b.u(8)


def hevc_sps(nal: bytes) -> dict:
    b = _Bits(_unescape(nal[2:]))
    b.u(4)
    max_sub = b.u(3)
    b.u(1)
    _hevc_ptl(b, max_sub)
    b.ue()
    sps = {"sar": (0, 1)}
    c = b.ue()
    if c > 3:
        raise BitstreamError("bad chroma_format_idc")
    sps["chroma"] = c
    if c == 3:
        b.u(1)
    w, h = b.ue(), b.ue()
    if b.u(1):
        sw = 2 if c in (1, 2) else 1
        sh = 2 if c == 1 else 1
        left, right, top, bottom = b.ue(), b.ue(), b.ue(), b.ue()
        w -= sw * (left + right)
        h -= sh * (top + bottom)
    sps["width"], sps["height"] = w, h
    sps["depth"] = b.ue() + 8
    b.ue()
    log2_poc = b.ue() + 4
    start = 0 if b.u(1) else max_sub
    for _ in range(start, max_sub + 1):
        b.ue()
        b.ue()
        b.ue()
    for _ in range(6):
        b.ue()
    if b.u(1) and b.u(1):  # scaling_list_enabled, sps_scaling_list_data_present
        for size_id in range(4):
            for _ in range(0, 6, 3 if size_id == 3 else 1):
                if not b.u(1):
                    b.ue()
                else:
                    n = min(64, 1 << (4 + (size_id << 1)))
                    if size_id > 1:
                        b.se()
                    for _ in range(n):
                        b.se()
    b.u(1)
    b.u(1)
    if b.u(1):  # pcm_enabled_flag
        b.u(8)
        b.ue()
        b.ue()
        b.u(1)
    n_sets = b.ue()
    if n_sets > 64:
        raise BitstreamError("too many short-term RPS")
    num_delta = []
    for i in range(n_sets):
        if i and b.u(1):  # inter_ref_pic_set_prediction_flag
            b.u(1)
            b.ue()
            k = 0
            for _ in range(num_delta[i - 1] + 1):
                used = b.u(1)
                if used or b.u(1):
                    k += 1
            num_delta.append(k)
        else:
            neg, pos = b.ue(), b.ue()
            if neg > 16 or pos > 16:
                raise BitstreamError("bad RPS")
            for _ in range(neg + pos):
                b.ue()
                b.u(1)
            num_delta.append(neg + pos)
    if b.u(1):  # long_term_ref_pics_present_flag
        for _ in range(min(b.ue(), 33)):
            b.u(log2_poc)
            b.u(1)
    b.u(1)
    b.u(1)
    if b.u(1):  # vui_parameters_present_flag
        _vui_common(b, sps)
    return sps


def avcc_sets(ext: bytes):
    """The one SPS of an avcC record and its PPSs."""
    if len(ext) < 7 or ext[0] != 1 or ext[5] & 0x1F != 1:
        raise BitstreamError("avcC without exactly one SPS")

    def entries(pos, count):
        got = []
        for _ in range(count):
            if pos + 2 > len(ext):
                raise BitstreamError("bad avcC")
            n = int.from_bytes(ext[pos : pos + 2], "big")
            if n < 2 or pos + 2 + n > len(ext):
                raise BitstreamError("bad avcC")
            got.append(ext[pos + 2 : pos + 2 + n])
            pos += 2 + n
        return got, pos

    sps, pos = entries(6, 1)
    if pos >= len(ext):
        raise BitstreamError("avcC without a PPS")
    pps, _ = entries(pos + 1, ext[pos])
    if not pps:
        raise BitstreamError("avcC without a PPS")
    return sps[0], pps


def h264_pps_refs(nal: bytes) -> int:
    """num_ref_idx_l0_default_active of a PPS (what FFmpeg's parser calls ref_count[0])."""
    b = _Bits(_unescape(nal[1:]))
    b.ue()
    b.ue()
    b.u(1)
    b.u(1)
    if b.ue() != 0:
        raise BitstreamError("slice groups")
    return b.ue() + 1


def hvcc_nals(ext: bytes) -> list:
    """Every NAL unit of an hvcC record's arrays."""
    if len(ext) < 23 or ext[0] != 1:
        raise BitstreamError("bad hvcC")
    pos, out = 23, []
    for _ in range(ext[22]):
        if pos + 3 > len(ext):
            raise BitstreamError("bad hvcC")
        cnt = int.from_bytes(ext[pos + 1 : pos + 3], "big")
        pos += 3
        for _ in range(cnt):
            if pos + 2 > len(ext):
                raise BitstreamError("bad hvcC")
            n = int.from_bytes(ext[pos : pos + 2], "big")
            if pos + 2 + n > len(ext):
                raise BitstreamError("bad hvcC")
            out.append(ext[pos + 2 : pos + 2 + n])
            pos += 2 + n
    return out


def hvcc_sps(ext: bytes) -> bytes:
    """The first SPS of an hvcC record (the one FFmpeg's decoder activates first)."""
    sps = [x for x in hvcc_nals(ext) if len(x) > 3 and (x[0] >> 1) & 0x3F == 33]
    if len(sps) != 1:
        raise BitstreamError("hvcC without exactly one SPS")
    return sps[0]


_SPACE_NAMES = {0: "rgb", 1: "bt709", 2: "unspecified", 4: "fcc", 5: "bt470bg", 6: "smpte170m",
                7: "smpte240m", 8: "ycgco", 9: "bt2020nc", 10: "bt2020c"}


def _space_name(m: int) -> str:
    if m > 14:  # values FFmpeg may name differently across versions
        raise BitstreamError("matrix coefficients beyond the known table")
    return _SPACE_NAMES.get(m, str(m))


def pixel_props(codec: str, sps: dict, colr: dict | None):
    """(pix_fmt, color_space name, color_range name) as FFmpeg's decoder reports them."""
    c, d = sps["chroma"], sps["depth"]
    if codec == "hevc":  # the decoder sets all three from the SPS, whatever the container says
        full = sps.get("full_range", 0)
        matrix = sps.get("matrix", 2)
        if d not in (8, 10, 12):
            raise BitstreamError("bit depth")
        base = ("gray", "yuv420p", "yuv422p", "yuv444p")[c]
        fmt = base if d == 8 else f"{base}{d}le"
        if fmt == "yuv420p" and full:  # the one format FFmpeg's HEVC SPS reader turns into yuvj
            fmt = "yuvj420p"
        return fmt, _space_name(matrix), "pc" if full else "tv"
    full = None
    matrix = 2
    if colr is not None:
        matrix = colr["matrix"]
        if "full" in colr:
            full = colr["full"]
    if "full_range" in sps:
        full = sps["full_range"]
    if "matrix" in sps:
        matrix = sps["matrix"]
    if c == 0 or (c == 3 and matrix == 0):
        raise BitstreamError("monochrome or RGB H.264")
    base = ("", "yuv420p", "yuv422p", "yuv444p")[c]
    if d == 8:
        fmt = base.replace("yuv", "yuvj") if full else base
    elif d in (9, 10, 12, 14):
        fmt = f"{base}{d}le"
    else:
        raise BitstreamError("bit depth")
    rng = "unspecified" if full is None else ("pc" if full else "tv")
    return fmt, _space_name(matrix), rng


def is_i_slice(words, avail):
    """Whether slice_type is I, from the 40 bits after an H.264 slice NAL header (first_mb_in_slice
    and slice_type, two exp-Golomb codes); refused where the codes do not fit in them."""
    w = words.astype(np.float64)
    ok = words > 0
    lz1 = np.where(ok, 39 - np.floor(np.log2(np.where(ok, w, 1.0))), 99).astype(np.int64)
    used = 2 * lz1 + 1
    rem_bits = 40 - used
    ok &= rem_bits > 0
    rem = np.where(ok, words & ((np.int64(1) << np.clip(rem_bits, 0, 40)) - 1), 0)
    ok &= rem > 0
    lz2 = np.where(ok, (rem_bits - 1) - np.floor(np.log2(np.where(rem > 0, rem, 1).astype(np.float64))), 99)
    lz2 = lz2.astype(np.int64)
    ok &= (2 * lz2 + 1 <= rem_bits) & (avail >= 5)
    if not ok.all():
        raise BitstreamError("slice header beyond the bytes read")
    st = (rem >> np.clip(rem_bits - (2 * lz2 + 1), 0, 40)) - 1
    return (st % 5) == 2


def sei_has_recovery_point(data: bytes) -> bool:
    b = _unescape(data)
    p, n = 0, len(b)
    while p < n and not (p == n - 1 and b[p] == 0x80):
        typ = 0
        while p < n and b[p] == 0xFF:
            typ += 255
            p += 1
        if p >= n:
            raise BitstreamError("SEI")
        typ += b[p]
        p += 1
        size = 0
        while p < n and b[p] == 0xFF:
            size += 255
            p += 1
        if p >= n:
            raise BitstreamError("SEI")
        size += b[p]
        p += 1
        if p + size > n:
            raise BitstreamError("SEI")
        if typ == 6:
            return True
        p += size
    return False
