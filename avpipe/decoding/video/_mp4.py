"""A direct reader of MP4 / MOV sample tables, for a first open without a demux pass.

:func:`read_video_track` parses the ``moov`` box of a file (never the media data except the first
bytes of each sample, for the NAL headers) and returns, for the file's one H.264 / HEVC video
track, what FFmpeg's MOV demuxer would hand out packet by packet: each packet's dts, pts, key
flag, byte offset and size, in decode order, with the packets FFmpeg marks as discarded (before
an edit list's start) left out, plus the stream properties FFmpeg reports after opening the file
(dimensions, pixel format, colour tags, rotation, sample aspect ratio).

The rules follow libavformat/mov.c (``mov_build_index``, ``mov_fix_index``, ``mov_read_packet``)
and the H.264 / HEVC decoders' export of SPS fields (the bitstream parser is ``_nal.py``).
Anything outside the cases reproduced exactly raises :class:`DemuxScanNeeded` and the caller
falls back to a demux scan: fragmented files, several video tracks, edit lists other than one
plain entry, negative composition offsets, partial sync samples, sample groups, several sample
descriptions, tables that disagree, samples past the end of the file, parameter sets it cannot
parse. Every count read from the file is checked against the bytes that hold it, so a damaged
file costs no more than its size.

Where each field comes from (all in decode order unless said):

* dts / pts: ``stts`` deltas summed, plus ``ctts`` offsets; with an edit list (one entry, or an
  empty entry then one), ``mov_fix_index``: samples from the keyframe at or before the edit's
  media time are kept, those whose composition time falls outside the edit are discarded (and
  left out here, as the demux scan skips them), and times are shifted so the first kept sample
  in the edit has dts = the empty edit's length (then pts moved so the earliest is >= 0).
* packet durations: the ``stts`` delta of each sample (what this FFmpeg's MOV demuxer reports).
* key flags: H.264 packets get them from FFmpeg's H.264 parser (IDR slice, a recovery point SEI,
  or any I slice when the SPS allows one reference frame and the PPS one L0 reference), so they
  are read from the samples' NAL units; HEVC packets from ``stss`` (all samples when absent).
* byte offsets and sizes: ``stsc`` x ``stco`` / ``co64`` and ``stsz`` / ``stz2``.
* disposable: each sample's NAL headers (the first NAL unit of every sample is gathered from an
  mmap of the file in one numpy indexing step; samples with several NAL units are walked).
  It is about a third of the reader's time (docs/how-it-works.md, "Measured trade-offs"), so it is
  computed at open rather than lazily.
* width / height: the sample entry (checked against the SPS with its cropping); pixel format,
  colour space and range: the SPS (chroma format, bit depth, VUI) and, for H.264 only, a ``colr``
  box where the SPS says nothing (HEVC's decoder overrides the container); the pixel format as
  FFmpeg names it (``yuvj420p`` for full-range 8-bit 4:2:0).
* rotation: the display matrix (``tkhd`` x ``mvhd``) through av_display_rotation_get, truncated
  to an int like PyAV; sample aspect ratio: ``pasp``, else a scaling display matrix, else a
  ``tkhd`` size other than the coded one, else the SPS VUI.

Pure: the standard library and numpy only.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ...formats import MP4_EXTENSIONS, NON_MP4_CONTAINER_EXTENSIONS
from ._nal import (
    BitstreamError,
    avcc_sets,
    h264_pps_refs,
    h264_sps,
    hevc_sps,
    hvcc_nals,
    hvcc_sps,
    is_i_slice,
    pixel_props,
    sei_has_recovery_point,
)

__all__ = ["DemuxScanNeeded", "Mp4Video", "looks_like_mp4", "read_video_track"]

CONTAINER_NAME = "mov,mp4,m4a,3gp,3g2,mj2"
_CODECS = {b"avc1": "h264", b"avc3": "h264", b"hvc1": "hevc", b"hev1": "hevc"}
_MAX_MOOV = 1 << 30


class DemuxScanNeeded(Exception):
    """The file is not one this reader reproduces exactly: the caller scans it by demuxing
    (``_scan.py``). Not an error about the file (that is :class:`~avpipe.errors.DecodeError`):
    the demux scan decides whether it is damaged."""


@dataclass
class Mp4Video:
    stream_index: int
    codec: str
    extradata: bytes
    width: int
    height: int
    timescale: int
    # per retained packet, decode order
    dts: np.ndarray
    pts: np.ndarray
    key: np.ndarray
    pos: np.ndarray
    size: np.ndarray
    duration: np.ndarray  # the packet's duration as the demuxer reports it (0: none)
    pix_fmt: str
    color_space: str
    color_range: str
    rotation: int
    sample_aspect_ratio: Fraction | None
    disposable: np.ndarray | None = None
    nal_size: int = 0
    container: str = CONTAINER_NAME
    intra_key: bool = False
    param_sets: frozenset | None = None  # the sample entry's parameter set NAL units


def looks_like_mp4(path: str) -> bool:
    """Whether to try the reader: the name ends in .mp4 / .mov / .m4v, or (for names that are not
    another container's) the file's first box is ``ftyp``."""
    low = path.lower()
    if low.endswith(MP4_EXTENSIONS):
        return True
    if low.endswith(NON_MP4_CONTAINER_EXTENSIONS):
        return False
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(8)
    except OSError:
        return False
    return len(head) == 8 and head[4:8] == b"ftyp"


# --------------------------------------------------------------------------------------------
# boxes
# --------------------------------------------------------------------------------------------


def _boxes(buf: bytes, start: int, end: int):
    """(type, payload start, payload end) of each box in buf[start:end], bounds-checked."""
    pos = start
    while pos + 8 <= end:
        size, typ = struct.unpack_from(">I4s", buf, pos)
        hdr = 8
        if size == 1:
            if pos + 16 > end:
                raise DemuxScanNeeded("truncated box header")
            size = struct.unpack_from(">Q", buf, pos + 8)[0]
            hdr = 16
        elif size == 0:
            size = end - pos
        if size < hdr or pos + size > end:
            raise DemuxScanNeeded(f"box {typ!r} overruns its parent")
        yield typ, pos + hdr, pos + size
        pos += size
    if pos != end and end - pos >= 8:
        raise DemuxScanNeeded("trailing bytes in a box")


def _children(buf, start, end) -> dict:
    out: dict = {}
    for typ, a, b in _boxes(buf, start, end):
        out.setdefault(typ, []).append((a, b))
    return out


def _one(kids: dict, typ: bytes, required: bool = True):
    got = kids.get(typ)
    if not got:
        if required:
            raise DemuxScanNeeded(f"no {typ.decode('latin-1')} box")
        return None
    if len(got) > 1:
        raise DemuxScanNeeded(f"several {typ.decode('latin-1')} boxes")
    return got[0]


def _read_moov(fd: int, file_size: int) -> bytes:
    pos = 0
    first = True
    while pos + 8 <= file_size:
        head = os.pread(fd, 16, pos)
        if len(head) < 8:
            break
        size, typ = struct.unpack_from(">I4s", head, 0)
        hdr = 8
        if size == 1:
            if len(head) < 16:
                raise DemuxScanNeeded("truncated box header")
            size = struct.unpack_from(">Q", head, 8)[0]
            hdr = 16
        elif size == 0:
            size = file_size - pos
        if first and typ not in (b"ftyp", b"moov", b"free", b"skip", b"wide", b"mdat"):
            raise DemuxScanNeeded("not an ISO BMFF file")
        first = False
        if size < hdr or pos + size > file_size:
            raise DemuxScanNeeded(f"top-level box {typ!r} overruns the file")
        if typ in (b"moof", b"mfra", b"sidx"):
            raise DemuxScanNeeded("fragmented file")
        if typ == b"moov":
            if size > _MAX_MOOV:
                raise DemuxScanNeeded("moov too large")
            data = os.pread(fd, size, pos)
            if len(data) != size:
                raise DemuxScanNeeded("short read")
            return data[hdr:]
        pos += size
    raise DemuxScanNeeded("no moov box")


def _full(buf, a, b, need0: int, need1: int):
    """A full box's version and where its fields start; its size checked for that version."""
    if b - a < 4:
        raise DemuxScanNeeded("box too short")
    ver = buf[a]
    if b - a < 4 + (need1 if ver == 1 else need0):
        raise DemuxScanNeeded("box too short")
    return ver, a + 4


def _table(buf, a, b, fmt: str, hdr: int, fields: int = 1):
    """The entry count at a+hdr-4 and that many entries after it (count checked against the
    box, so an absurd count never allocates)."""
    if b - a < hdr:
        raise DemuxScanNeeded("table box too short")
    (n,) = struct.unpack_from(">I", buf, a + hdr - 4)
    width = np.dtype(fmt).itemsize * fields
    if n * width > b - (a + hdr):
        raise DemuxScanNeeded("table count exceeds its box")
    return np.frombuffer(buf, dtype=fmt, count=n * fields, offset=a + hdr)


# --------------------------------------------------------------------------------------------
# the track
# --------------------------------------------------------------------------------------------

def _matrix(buf, at) -> list:
    return list(struct.unpack_from(">9i", buf, at))


def _reduce(num: int, den: int, mx: int = 0x7FFFFFFF):
    """libavutil's av_reduce (the best approximation with terms <= mx)."""
    a0n, a0d, a1n, a1d = 0, 1, 1, 0
    g = math.gcd(num, den)
    if g:
        num, den = num // g, den // g
    if num <= mx and den <= mx:
        a1n, a1d, den = num, den, 0
    while den:
        x = num // den
        nxt = num - den * x
        a2n, a2d = x * a1n + a0n, x * a1d + a0d
        if a2n > mx or a2d > mx:
            if a1n:
                x = (mx - a0n) // a1n
            if a1d:
                x = min(x, (mx - a0d) // a1d)
            if den * (2 * x * a1d + a0d) > num * a1d:
                a1n, a1d = x * a1n + a0n, x * a1d + a0d
            break
        a0n, a0d, a1n, a1d = a1n, a1d, a2n, a2d
        num, den = den, nxt
    return a1n, a1d


def _d2q(d: float) -> Fraction | None:
    """libavutil's av_d2q(d, INT_MAX) for a positive finite d, as PyAV reports it."""
    if not d > 0 or d > 0x7FFFFFFF + 3 or math.isinf(d):
        raise DemuxScanNeeded("aspect ratio")
    exp = max(math.frexp(d)[1] - 1, 0)
    den = 1 << (62 - exp)
    n, q = _reduce(int(math.floor(d * float(den) + 0.5)), den)
    return Fraction(n, q) if n and q else None


def _display_matrix(tkhd_m: list, mvhd_m: list) -> list | None:
    """FFmpeg's display matrix (tkhd times mvhd, in its fixed-point steps), None if identity."""
    sh = (16, 16, 30)
    res = []
    for i in range(3):
        for j in range(3):
            acc = 0
            for e in range(3):
                acc += (tkhd_m[i * 3 + e] * mvhd_m[e * 3 + j]) >> sh[e]
            res.append(acc)
    if any(not -(1 << 31) <= v < (1 << 31) for v in res):
        raise DemuxScanNeeded("display matrix overflow")
    if res == [1 << 16, 0, 0, 0, 1 << 16, 0, 0, 0, 1 << 30]:
        return None
    return res


def _rotation(flat: list) -> int:
    # av_display_rotation_get, in its operation order; PyAV casts the double to a C int
    # (truncation, NaN -> INT_MIN)
    m = [v / 65536.0 for v in flat]
    s0 = math.hypot(m[0], m[3])
    s1 = math.hypot(m[1], m[4])
    if s0 == 0.0 or s1 == 0.0:
        return -(1 << 31) % 360
    rot = -(math.atan2(m[1] / s1, m[0] / s0) * 180 / math.pi)
    return int(rot) % 360


def _sample_entry(buf, a, b):
    """The stsd's one sample entry: (codec, width, height, extradata, colr, pasp)."""
    if b - a < 8:
        raise DemuxScanNeeded("short stsd")
    (count,) = struct.unpack_from(">I", buf, a + 4)
    entries = list(_boxes(buf, a + 8, b))
    if count != 1 or len(entries) != 1:
        raise DemuxScanNeeded("not exactly one sample description")
    typ, ea, eb = entries[0]
    codec = _CODECS.get(typ)
    if codec is None:
        raise DemuxScanNeeded(f"sample entry {typ!r}")
    if eb - ea < 78:
        raise DemuxScanNeeded("short visual sample entry")
    width, height = struct.unpack_from(">HH", buf, ea + 24)
    kids = _children(buf, ea + 78, eb)
    cfg = _one(kids, b"avcC" if codec == "h264" else b"hvcC")
    extradata = bytes(buf[cfg[0] : cfg[1]])
    colr = None
    for ca, cb in kids.get(b"colr", []):
        kind = buf[ca : ca + 4]
        if kind in (b"nclx", b"nclc"):
            if colr is not None:
                raise DemuxScanNeeded("several colr boxes")
            if cb - ca < (11 if kind == b"nclx" else 10):
                raise DemuxScanNeeded("short colr")
            colr = {"matrix": struct.unpack_from(">H", buf, ca + 8)[0]}
            if kind == b"nclx":
                colr["full"] = buf[ca + 10] >> 7
    pasp = None
    p = _one(kids, b"pasp", required=False)
    if p is not None:
        if p[1] - p[0] < 8:
            raise DemuxScanNeeded("short pasp")
        h, v = struct.unpack_from(">II", buf, p[0])
        if h and v:
            if h > 0x7FFFFFFF or v > 0x7FFFFFFF:
                raise DemuxScanNeeded("pasp")
            pasp = Fraction(h, v)
    return codec, width, height, extradata, colr, pasp


def read_video_track(path: str, stream_index=None) -> Mp4Video:
    """The one H.264 / HEVC video track of an MP4 / MOV file; raises :class:`DemuxScanNeeded`
    (also for a parameter set or slice header the bitstream parser does not read)."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        file_size = os.fstat(fd).st_size
        moov = _read_moov(fd, file_size)
        try:
            info = _parse_moov(moov, stream_index, file_size)
            info.disposable, parser_key = _nal_scan(fd, file_size, info)
        except BitstreamError as e:
            raise DemuxScanNeeded(str(e)) from None
        if parser_key is not None:
            info.key = parser_key
    return info


def _parse_moov(buf: bytes, stream_index, file_size: int) -> Mp4Video:
    if b"covr" in buf or b"mvex" in buf:  # cover art streams, fragments: leave to FFmpeg
        raise DemuxScanNeeded("cover art or fragments")
    top = _children(buf, 0, len(buf))
    mvhd = _one(top, b"mvhd")
    ver, p = _full(buf, *mvhd, 68, 80)
    if ver == 1:
        movie_scale = struct.unpack_from(">I", buf, p + 16)[0]
        mvhd_m = _matrix(buf, p + 16 + 4 + 8 + 4 + 2 + 10)
    else:
        movie_scale = struct.unpack_from(">I", buf, p + 8)[0]
        mvhd_m = _matrix(buf, p + 8 + 4 + 4 + 4 + 2 + 10)
    traks = []
    for typ, a, b in _boxes(buf, 0, len(buf)):
        if typ == b"trak":
            traks.append((a, b))
    videos = []
    for i, (a, b) in enumerate(traks):
        kids = _children(buf, a, b)
        mdia = _one(kids, b"mdia")
        mk = _children(buf, *mdia)
        hdlr = _one(mk, b"hdlr")
        if hdlr[1] - hdlr[0] >= 12 and buf[hdlr[0] + 8 : hdlr[0] + 12] == b"vide":
            videos.append((i, kids, mk))
    if len(videos) != 1:
        raise DemuxScanNeeded("not exactly one video track")
    index, kids, mk = videos[0]
    if stream_index is not None and int(stream_index) != index:
        raise DemuxScanNeeded("another stream asked for")
    tkhd = _one(kids, b"tkhd")
    ver, p = _full(buf, *tkhd, 72, 84)
    tkhd_m = _matrix(buf, p + (32 if ver == 1 else 20) + 16)
    matrix_sar = None
    display = _display_matrix(tkhd_m, mvhd_m)
    rotation = _rotation(display) if display is not None else 0
    tk_w, tk_h = struct.unpack_from(">II", buf, p + (32 if ver == 1 else 20) + 52)
    if display is not None and tk_w and tk_h:
        # mov_read_tkhd gives the stream a pixel aspect ratio from a matrix that scales x and y
        # differently (av_d2q of the ratio)
        d0, d1 = math.hypot(display[0], display[3]), math.hypot(display[1], display[4])
        if d0 > 1 and d1 > 1 and d0 < (1 << 24) and d1 < (1 << 24) and abs(d0 / d1 - 1.0) > 0.01:
            matrix_sar = _d2q(d0 / d1)

    mdhd = _one(mk, b"mdhd")
    ver, p = _full(buf, *mdhd, 16, 28)
    # the timescale; the duration after it (mdhd's) is not used: the sample tables give it
    timescale = struct.unpack_from(">I", buf, p + (16 if ver == 1 else 8))[0]
    if timescale <= 0 or timescale > 0x7FFFFFFF:
        raise DemuxScanNeeded("timescale")
    minf = _children(buf, *_one(mk, b"minf"))
    dinf = _one(minf, b"dinf", required=False)
    if dinf is not None:  # sample data in another file (a non-self-contained data reference)
        dref = _one(_children(buf, *dinf), b"dref", required=False)
        if dref is not None:
            if dref[1] - dref[0] < 8:
                raise DemuxScanNeeded("short dref")
            for _typ, da, db in _boxes(buf, dref[0] + 8, dref[1]):
                if db - da < 4 or not buf[da + 3] & 1:
                    raise DemuxScanNeeded("external data reference")
    st = _children(buf, *_one(minf, b"stbl"))
    for bad in (b"stps", b"sbgp", b"sgpd", b"stsh", b"padb", b"cslg", b"saiz", b"senc"):
        if bad in st:
            raise DemuxScanNeeded(f"{bad!r} box")
    codec, w, h, extradata, colr, pasp = _sample_entry(buf, *_one(st, b"stsd"))

    # ---- sample sizes
    if b"stsz" in st:
        a, b = _one(st, b"stsz")
        if b - a < 12:
            raise DemuxScanNeeded("short stsz")
        const, n = struct.unpack_from(">II", buf, a + 4)
        if const:
            if n > file_size:
                raise DemuxScanNeeded("stsz count")
            sizes = np.full(n, const, np.int64)
        else:
            sizes = _table(buf, a, b, ">u4", 12).astype(np.int64)
    else:
        a, b = _one(st, b"stz2")
        if b - a < 12:
            raise DemuxScanNeeded("short stz2")
        field, n = buf[a + 7], struct.unpack_from(">I", buf, a + 8)[0]
        if field not in (4, 8, 16) or (n * field + 7) // 8 > b - a - 12:
            raise DemuxScanNeeded("stz2")
        if field == 16:
            sizes = np.frombuffer(buf, ">u2", n, a + 12).astype(np.int64)
        elif field == 8:
            sizes = np.frombuffer(buf, "u1", n, a + 12).astype(np.int64)
        else:
            raw = np.frombuffer(buf, "u1", (n + 1) // 2, a + 12)
            sizes = np.stack([raw >> 4, raw & 15], 1).reshape(-1)[:n].astype(np.int64)
    n = int(sizes.size)
    if n == 0:
        raise DemuxScanNeeded("no samples")
    if (sizes > 0x3FFFFFFF).any():
        raise DemuxScanNeeded("huge sample")

    # ---- decode times
    stts = _table(buf, *_one(st, b"stts"), ">u4", 8, 2).reshape(-1, 2)
    if stts.size == 0:
        raise DemuxScanNeeded("empty stts")
    counts = stts[:, 0].astype(np.int64)
    deltas = stts[:, 1].astype(np.int64)
    if counts.sum() != n or (deltas > 0x7FFFFFFF).any():
        raise DemuxScanNeeded("stts")
    sample_deltas = np.repeat(deltas, counts)
    if (sample_deltas[:-1] <= 0).any():
        raise DemuxScanNeeded("samples sharing a decode time")
    dts_old = np.zeros(n, np.int64)
    np.cumsum(sample_deltas[:-1], out=dts_old[1:])

    # ---- composition offsets
    ctts = None
    if b"ctts" in st:
        tab = _table(buf, *_one(st, b"ctts"), ">i4", 8, 2).reshape(-1, 2)
        tab = tab[tab[:, 0] > 0]
        if tab.shape[0]:
            if (tab[:, 1] < 0).any():
                raise DemuxScanNeeded("negative composition offsets")
            c_counts = tab[:, 0].astype(np.int64)
            if c_counts.sum() != n:
                raise DemuxScanNeeded("ctts count")
            ctts = np.repeat(tab[:, 1].astype(np.int64), c_counts)
    offs = ctts if ctts is not None else np.zeros(n, np.int64)

    # ---- sync samples
    if b"stss" in st:
        ss = _table(buf, *_one(st, b"stss"), ">u4", 8).astype(np.int64)
        key = np.zeros(n, bool)
        if ss.size == 0:  # FFmpeg then parses the stream for key frames
            if codec != "h264":
                raise DemuxScanNeeded("empty stss")
            key[0] = True
        else:
            if ss.size > 1 and (np.diff(ss) <= 0).any():
                raise DemuxScanNeeded("stss order")
            idx = ss - (1 if ss[0] > 0 else 0)
            key[idx[idx < n]] = True
    else:
        key = np.ones(n, bool)

    # ---- byte positions
    if b"stco" in st:
        chunks = _table(buf, *_one(st, b"stco"), ">u4", 8).astype(np.int64)
    else:
        chunks = _table(buf, *_one(st, b"co64"), ">u8", 8)
        if (chunks > (1 << 62)).any():
            raise DemuxScanNeeded("co64")
        chunks = chunks.astype(np.int64)
    stsc = _table(buf, *_one(st, b"stsc"), ">u4", 8, 3).reshape(-1, 3).astype(np.int64)
    nch = int(chunks.size)
    if not stsc.shape[0] or not nch or stsc[0, 0] != 1 or (stsc[:, 2] != 1).any():
        raise DemuxScanNeeded("stsc")
    firsts = stsc[:, 0]
    if (np.diff(firsts) <= 0).any() or firsts[-1] > nch or (stsc[:, 1] <= 0).any():
        raise DemuxScanNeeded("stsc")
    per_chunk = np.repeat(stsc[:, 1], np.diff(np.append(firsts, nch + 1)))
    if int(per_chunk.sum()) != n:
        raise DemuxScanNeeded("stsc sample count")
    chunk_of = np.repeat(np.arange(nch), per_chunk)
    csum = np.zeros(n + 1, np.int64)
    np.cumsum(sizes, out=csum[1:])
    chunk_start = np.zeros(nch, np.int64)
    np.cumsum(per_chunk[:-1], out=chunk_start[1:])
    pos_all = chunks[chunk_of] + csum[:-1] - csum[chunk_start[chunk_of]]
    if (pos_all < 0).any() or int((pos_all + sizes).max()) > file_size:
        raise DemuxScanNeeded("samples past the end of the file")

    # ---- edit list (mov_fix_index for one plain entry)
    keep = np.arange(n)
    discard = np.zeros(n, bool)
    dts = dts_old
    elst = None
    if b"edts" in kids:
        ek = _children(buf, *_one(kids, b"edts"))
        e = _one(ek, b"elst", required=False)
        if e is not None:
            a, b = e
            ver = buf[a] if b > a else 0
            ent = _table(buf, a, b, ">u8,>i8,>i4" if ver == 1 else ">u4,>i4,>i4", 8)
            elst = [(int(x[0]), int(x[1]), int(x[2])) for x in ent[:3]]
            if len(ent) > 2 or (len(ent) == 2 and elst[0][1] != -1):
                raise DemuxScanNeeded("several edits")
            elst = elst or None
    empty = 0
    if elst is not None:
        if movie_scale <= 0:
            raise DemuxScanNeeded("movie timescale")
        if len(elst) == 2:  # an empty edit first: the media starts that much later
            empty = (elst[0][0] * timescale + movie_scale // 2) // movie_scale
        seg_dur, media_time, rate = elst[-1]
        if media_time < 0 or rate != 0x10000:
            raise DemuxScanNeeded("edit list kind")
        dur = (seg_dur * timescale + movie_scale // 2) // movie_scale  # av_rescale rounds
        if dur <= 0:
            raise DemuxScanNeeded("empty edit")
        k0 = _prev_key_index(dts_old, offs, key, media_time, ctts is not None)
        cts = dts_old + offs
        inside = (cts >= media_time) & (cts < media_time + dur)
        inside[:k0] = False
        first_in = int(np.argmax(inside)) if inside.any() else -1
        if first_in < 0:
            raise DemuxScanNeeded("no sample inside the edit")
        fd = np.empty(n, np.int64)
        fd[:-1] = np.diff(dts_old)
        fd[-1] = dur
        end = n
        stop = np.nonzero((cts + fd >= media_time + dur) & key)[0]
        stop = stop[stop >= k0]
        if stop.size:
            end = int(stop[1] if ctts is not None and stop.size > 1 else stop[0]) + 1
            if ctts is not None and stop.size == 1:
                end = n
        keep = np.arange(k0, end)
        dts = dts_old[keep] - dts_old[first_in] + empty
        discard = ~inside[keep]
        offs_k = offs[keep]
        mcp = int((dts + offs_k)[~discard].min()) - empty
        if mcp > 0:
            dts = dts - mcp
    pts = dts + offs[keep]
    # packet durations: FFmpeg's MOV demuxer gives each packet its stts delta
    durs = sample_deltas[keep]
    if (durs <= 0).any():
        raise DemuxScanNeeded("zero sample duration")
    retained = ~discard
    sel = keep[retained]

    intra_key = False
    if codec == "h264":
        sps_nal, pps_nals = avcc_sets(extradata)
        param_sets = frozenset([sps_nal, *pps_nals])
        sps = h264_sps(sps_nal)
        nal_size = (extradata[4] & 3) + 1
        # FFmpeg's H.264 parser (which sets the demuxed packets' key flags in MP4, whatever
        # stss says) also takes any I picture of a one-reference stream for a key frame
        refs = {h264_pps_refs(x) <= 1 for x in pps_nals}
        if len(refs) != 1:
            raise DemuxScanNeeded("PPSs differ in reference counts")
        intra_key = sps["ref_frames"] <= 1 and refs.pop()
    else:
        sps = hevc_sps(hvcc_sps(extradata))
        param_sets = frozenset(hvcc_nals(extradata))
        nal_size = (extradata[21] & 3) + 1 if len(extradata) >= 22 else 0
    if (sps["width"], sps["height"]) != (w, h) or w <= 0 or h <= 0:
        raise DemuxScanNeeded("sample entry and SPS sizes differ")
    pix_fmt, space, rng = pixel_props(codec, sps, colr)
    tk_w, tk_h = tk_w >> 16, tk_h >> 16
    if pasp is not None:
        sar = pasp
    elif matrix_sar is not None:
        sar = matrix_sar
    elif tk_w and tk_h and (tk_w, tk_h) != (w, h):
        # mov_read_trak: a track size other than the coded one is an aspect ratio
        sar = _d2q((float(h) * tk_w) / (float(w) * tk_h))
    else:
        num, den = sps["sar"]
        sar = Fraction(num, den) if num and den else None
    return Mp4Video(
        stream_index=index,
        codec=codec,
        extradata=extradata,
        width=w,
        height=h,
        timescale=int(timescale),
        dts=dts[retained],
        pts=pts[retained],
        key=key[sel],
        pos=pos_all[sel],
        size=sizes[sel],
        duration=durs[retained],
        pix_fmt=pix_fmt,
        color_space=space,
        color_range=rng,
        rotation=rotation,
        sample_aspect_ratio=sar,
        nal_size=nal_size,
        intra_key=intra_key,
        param_sets=param_sets,
    )


def _prev_key_index(dts, offs, key, ts: int, has_ctts: bool) -> int:
    """find_prev_closest_index: the keyframe to start copying samples from (0 if none)."""
    for any_frame in (False, True):
        # av_index_search_timestamp(BACKWARD): the last entry with dts <= ts
        m = int(np.searchsorted(dts, ts, side="right")) - 1
        if not any_frame:
            while m >= 0 and not key[m]:
                m -= 1
        if m >= 0:
            i = m
            while i > 0 and dts[i] == dts[i - 1]:
                if any_frame or key[i - 1]:
                    m = i - 1
                i -= 1
        if has_ctts and m >= 0:
            while m >= 0 and not (dts[m] + offs[m] <= ts and key[m]):
                m -= 1
        if m >= 0:
            return m
    return 0


# --------------------------------------------------------------------------------------------
# disposable pictures: the first bytes of each sample
# --------------------------------------------------------------------------------------------


def _nal_scan(fd: int, file_size: int, v: Mp4Video):
    """Per packet, from the NAL unit headers at the start of each sample: whether no other
    picture references it (the rules of avpipe.decoding.video._nal), and for H.264 the key flag
    FFmpeg's parser gives it (IDR slice, recovery point SEI, or an I slice of a one-reference
    stream); samples whose NAL units do not exactly fill them are refused."""
    ls = v.nal_size
    hb = 1 if v.codec == "h264" else 2
    pos, size = v.pos, v.size
    n = pos.size
    if ls not in (1, 2, 4):
        raise DemuxScanNeeded("NAL length size")
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    try:
        arr = np.frombuffer(mm, np.uint8)
        # first NAL unit: its length prefix, header and the next 5 bytes, gathered at once
        width = ls + hb + 5
        take = np.minimum(pos[:, None] + np.arange(width)[None, :], file_size - 1)
        raw = arr[take].astype(np.int64)
        del arr
        length = np.zeros(n, np.int64)
        for k in range(ls):
            length = (length << 8) | raw[:, k]
        h0 = raw[:, ls]
        single = (length > 0) & (ls + length == size) & (size >= ls + hb)
        if v.codec == "h264":
            t = h0 & 0x1F
            is_slice = single & ((t == 1) | (t == 5))
            refs = ((h0 >> 5) & 3) != 0
            tids = np.zeros(n, np.int64)
        else:
            t = (h0 >> 1) & 0x3F
            is_slice = single & (t < 32)
            refs = ~((t < 16) & (t % 2 == 0))
            tids = (raw[:, ls + 1] & 7) - 1
        key = None
        if v.codec == "h264":
            key = single & (t == 5)
            if v.intra_key:
                words = np.zeros(n, np.int64)
                for k in range(5):
                    words = (words << 8) | raw[:, ls + 1 + k]
                key |= is_slice & is_i_slice(words, size - ls - 1)
        multi = np.nonzero(~single)[0]
        if multi.size:  # samples of several NAL units: walked together, unit by unit
            m_out, m_key, m_tmax, rest = _walk_many(raw_of(mm), file_size, pos[multi],
                                                    size[multi], ls, v)
        else:
            m_out = m_key = m_tmax = rest = np.zeros(0, np.int64)
        # the rare sample the vector walk leaves (an SEI before its first slice, in-band
        # parameter sets): one at a time
        walked = {int(multi[j]): _walk(mm, int(pos[multi[j]]), int(size[multi[j]]), ls, v)
                  for j in np.nonzero(rest)[0]}
        # in-band parameter sets (repeated headers) must be the sample entry's own: a stream
        # that changes them midway is left to the decoder-based scan
        if v.param_sets is not None and any(
            p not in v.param_sets for _, _, inband in walked.values() for p in inband
        ):
            raise DemuxScanNeeded("in-band parameter sets differ from the sample entry's")
        max_tid = int(tids[is_slice].max()) if is_slice.any() else 0
        if m_tmax.size and (~rest).any():
            max_tid = max(max_tid, int(m_tmax[~rest].max()))
        for h, _, _ in walked.values():
            for _, tid in h:
                max_tid = max(max_tid, tid)
        out = is_slice & ~refs & (tids == max_tid)
        if multi.size:
            vec = multi[~rest]
            out[vec] = m_out[~rest] & (m_tmax[~rest] == max_tid)
            if key is not None:
                key[vec] = m_key[~rest]
        for i, (h, k, _) in walked.items():
            out[i] = bool(h) and all((not r) and tid == max_tid for r, tid in h)
            if key is not None:
                key[i] = k
        return out, key
    finally:
        try:
            mm.close()
        except BufferError:
            pass


def raw_of(mm):
    return np.frombuffer(mm, np.uint8)


def _walk_many(arr, file_size, pos, size, ls, v):
    """:func:`_walk` for many samples at once (numpy, one step per NAL unit index).

    Returns per sample ``(disposable_if_max_tid, key, max_tid_of_its_slices, rest)``:
    ``disposable_if_max_tid``: it has slices, none referenced, all of one temporal id (equal to
    the third value; the caller compares it with the stream's highest); ``key``: the H.264
    parser's key flag (IDR, or an I slice of a one-reference stream); ``rest``: samples this
    walk does not decide (an SEI before the first slice, which may carry a recovery point;
    in-band parameter sets), to be walked by :func:`_walk`. Raises :class:`DemuxScanNeeded` as
    :func:`_walk` does where the NAL units do not fill a sample."""
    h264 = v.codec == "h264"
    hb = 1 if h264 else 2
    n = pos.size
    cur = pos.astype(np.int64).copy()
    end = cur + size.astype(np.int64)
    nslices = np.zeros(n, np.int64)
    any_ref = np.zeros(n, bool)
    tmin = np.full(n, 1 << 30, np.int64)
    tmax = np.full(n, -1, np.int64)
    seen_slice = np.zeros(n, bool)
    key = np.zeros(n, bool)
    rest = np.zeros(n, bool)
    width = ls + hb + 5
    active = cur < end
    while active.any():
        a = np.nonzero(active)[0]
        c, e = cur[a], end[a]
        if np.any(c + ls > e):
            raise DemuxScanNeeded("NAL units do not fill the sample")
        raw = arr[np.minimum(c[:, None] + np.arange(width)[None, :], file_size - 1)]
        raw = raw.astype(np.int64)
        length = np.zeros(a.size, np.int64)
        for k in range(ls):
            length = (length << 8) | raw[:, k]
        at = c + ls
        if np.any(length <= 0) or np.any(at + length > e):
            raise DemuxScanNeeded("NAL units do not fill the sample")
        h0 = raw[:, ls]
        first = ~seen_slice[a]
        if h264:
            t = h0 & 0x1F
            sl = (t == 1) | (t == 5)
            ref = ((h0 >> 5) & 3) != 0
            tid = np.zeros(a.size, np.int64)
            rest[a[(t == 6) & first]] = True  # a possible recovery point: the scalar walk
            rest[a[(t == 7) | (t == 8)]] = True
            fs = sl & first  # the sample's first slice decides its key flag
            k = fs & (t == 5)
            if v.intra_key:
                chk = fs & ~k
                if np.any(chk & (length < 6)):
                    raise DemuxScanNeeded("short slice")
                if chk.any():
                    words = np.zeros(a.size, np.int64)
                    for j in range(5):
                        words = (words << 8) | raw[:, ls + 1 + j]
                    ci = np.nonzero(chk)[0]
                    k[ci] = is_i_slice(words[ci], length[ci] - 1)
            key[a[fs]] = k[fs]
        else:
            if np.any(length < 2):
                raise DemuxScanNeeded("short NAL unit")
            t = (h0 >> 1) & 0x3F
            sl = t < 32
            ref = ~((t < 16) & (t % 2 == 0))
            tid = (raw[:, ls + 1] & 7) - 1
            rest[a[(t >= 32) & (t <= 34)]] = True
        s_a = a[sl]
        nslices[s_a] += 1
        any_ref[s_a] |= ref[sl]
        tmin[s_a] = np.minimum(tmin[s_a], tid[sl])
        tmax[s_a] = np.maximum(tmax[s_a], tid[sl])
        seen_slice[s_a] = True
        cur[a] = at + length
        active[a] = cur[a] < end[a]
    ok = (nslices > 0) & ~any_ref & (tmin == tmax)
    return ok, key, np.where(nslices > 0, tmax, 0), rest


def _walk(mm, start: int, n: int, ls: int, v: Mp4Video):
    """One sample's NAL units: [(is_reference, temporal_id)] of its slices (as
    _nal.slice_nal_headers) and, for H.264, the parser's key flag."""
    out = []
    inband = []
    pos = 0
    key = False
    first_slice = True
    recovery = False
    while pos < n:
        if pos + ls > n:
            raise DemuxScanNeeded("NAL units do not fill the sample")
        size = int.from_bytes(mm[start + pos : start + pos + ls], "big")
        at = pos + ls
        if size <= 0 or at + size > n:
            raise DemuxScanNeeded("NAL units do not fill the sample")
        h = mm[start + at : start + at + min(size, 8)]
        if v.codec == "h264":
            t = h[0] & 0x1F
            if t in (1, 5):
                out.append(((h[0] >> 5) & 3 != 0, 0))
                if first_slice:
                    first_slice = False
                    key = t == 5 or recovery
                    if not key and v.intra_key:
                        if size < 6:
                            raise DemuxScanNeeded("short slice")
                        word = int.from_bytes(h[1:6], "big")
                        key = bool(is_i_slice(np.array([word]), np.array([size - 1]))[0])
            elif t == 6 and first_slice:
                recovery = recovery or sei_has_recovery_point(mm[start + at + 1 : start + at + size])
            elif t in (7, 8):
                inband.append(mm[start + at : start + at + size])
        else:
            if size < 2:
                raise DemuxScanNeeded("short NAL unit")
            t = (h[0] >> 1) & 0x3F
            if t < 32:
                out.append((not (t < 16 and t % 2 == 0), (h[1] & 7) - 1))
            elif t in (32, 33, 34):
                inband.append(mm[start + at : start + at + size])
        pos = at + size
    return out, key, inband
