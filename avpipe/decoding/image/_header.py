"""Image headers read before decoding (private): the format from the first bytes, the picture's
size for the pixel cap, and the JPEG 2000 main-header check.

Both read a few header bytes, never pixels: ``image_size`` walks JPEG markers, PNG's IHDR, the
first TIFF IFD (classic and BigTIFF), a JPEG 2000 SIZ segment, BMP's info header, WebP's
VP8/VP8L/VP8X header and a PNM header. ``j2k_check`` walks a JPEG 2000 codestream's main
header (SOC to the first tile) and says what in it cannot be valid; where the walk reaches the
first tile with SIZ, COD and QCD seen and valid, the header is *vouched for*.

A source is read through a ``get(offset, n) -> bytes`` function (fewer bytes at the end), so
that a file on disk is read only where its header lies (a TIFF's IFD may sit at its end).
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["sniff_format", "FORMAT_NAMES", "image_size", "j2k_check", "bytes_reader",
           "file_reader"]


_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"II+\x00", "tiff"),
    (b"MM\x00+", "tiff"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "jpeg2000"),
    (b"\xff\x4f\xff\x51", "jpeg2000"),
    (b"BM", "bmp"),
)


def sniff_format(data: bytes) -> str | None:
    """The image format from the first bytes (``"jpeg"``, ``"png"``, ``"tiff"``, ``"jpeg2000"``,
    ``"bmp"``, ``"webp"``, ``"pnm"``), or None when it is none of those."""
    head = bytes(data[:16])
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if len(head) >= 3 and head[0:1] == b"P" and head[1:2] in b"123456" and head[2:3].isspace():
        return "pnm"
    return None


FORMAT_NAMES = {"jpeg": "JPEG", "png": "PNG", "tiff": "TIFF", "jpeg2000": "JPEG 2000",
                 "bmp": "BMP", "webp": "WebP", "pnm": "PNM"}  # fmt: skip


def bytes_reader(data):
    mv = memoryview(data)

    def get(off: int, n: int) -> bytes:
        if off < 0 or off >= len(mv):
            return b""
        return bytes(mv[off : off + n])

    return get


def file_reader(f, head: bytes = b""):
    """``get`` over an open binary file; ``head`` (the first bytes, already read) serves reads
    inside it without a seek."""

    def get(off: int, n: int) -> bytes:
        if off < 0:
            return b""
        if off + n <= len(head):
            return head[off : off + n]
        f.seek(off)
        return f.read(n)

    return get


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(get):
    at = 2
    for _ in range(10000):  # markers before the frame header (a hostile file: bounded)
        b = get(at, 4)
        if len(b) < 2 or b[0] != 0xFF:
            return None
        m = b[1]
        if m == 0xFF:  # fill byte
            at += 1
            continue
        if m in (0x01, *range(0xD0, 0xD8)):  # standalone markers
            at += 2
            continue
        if m in (0xD9, 0xDA) or len(b) < 4:  # end of image / start of scan before a frame
            return None
        n = int.from_bytes(b[2:4], "big")
        if m in _JPEG_SOF:
            s = get(at + 4, 5)
            if len(s) < 5:
                return None
            return int.from_bytes(s[1:3], "big"), int.from_bytes(s[3:5], "big")
        if n < 2:
            return None
        at += 2 + n
    return None


def _tiff_size(get):
    h = get(0, 16)
    bo = "<" if h[:2] == b"II" else ">"
    big = h[2:4] in (b"+\x00", b"\x00+")
    if big:
        ifd = struct.unpack(bo + "Q", h[8:16])[0]
        cnt_b = get(ifd, 8)
        if len(cnt_b) < 8:
            return None
        cnt, esz, first = struct.unpack(bo + "Q", cnt_b)[0], 20, ifd + 8
    else:
        ifd = struct.unpack(bo + "I", h[4:8])[0]
        cnt_b = get(ifd, 2)
        if len(cnt_b) < 2:
            return None
        cnt, esz, first = struct.unpack(bo + "H", cnt_b)[0], 12, ifd + 2
    body = get(first, esz * min(cnt, 4096))
    dims = {}
    for k in range(len(body) // esz):
        e = body[k * esz : (k + 1) * esz]
        tag, typ = struct.unpack(bo + "HH", e[:4])
        if tag not in (256, 257):
            continue
        val = e[12:] if big else e[8:]
        if typ == 3:  # SHORT
            dims[tag] = struct.unpack(bo + "H", val[:2])[0]
        elif typ == 4:  # LONG
            dims[tag] = struct.unpack(bo + "I", val[:4])[0]
        elif typ == 16 and big:  # LONG8
            dims[tag] = struct.unpack(bo + "Q", val[:8])[0]
    if 256 in dims and 257 in dims:
        return dims[257], dims[256]
    return None


def _webp_size(get):
    b = get(12, 18)
    if len(b) < 18:
        return None
    kind = b[:4]
    if kind == b"VP8X":
        w = int.from_bytes(b[12:15], "little") + 1
        h = int.from_bytes(get(27, 3), "little") + 1
        return h, w
    if kind == b"VP8L":
        bits = int.from_bytes(b[9:13], "little")
        return ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1
    if kind == b"VP8 ":
        s = get(26, 4)
        if len(s) < 4:
            return None
        return int.from_bytes(s[2:4], "little") & 0x3FFF, int.from_bytes(s[0:2], "little") & 0x3FFF
    return None


def _pnm_size(get):
    text = get(0, 1024)
    vals, i, tok = [], 2, b""
    while i < len(text) and len(vals) < 2:
        c = text[i : i + 1]
        if c == b"#":
            j = text.find(b"\n", i)
            i = len(text) if j < 0 else j
            continue
        if c.isdigit():
            tok += c
        elif tok:
            vals.append(int(tok))
            tok = b""
        elif not c.isspace():
            return None
        i += 1
    if len(vals) < 2:
        return None
    return vals[1], vals[0]


def image_size(get, fmt: str | None):
    """``(height, width)`` as the header declares it (before any EXIF rotation: the pixel
    count is the same), or None where the header does not say (left to the decoder)."""
    try:
        if fmt == "jpeg":
            return _jpeg_size(get)
        if fmt == "png":
            b = get(12, 21)  # "IHDR", its 13 bytes, its CRC
            if len(b) < 21 or b[:4] != b"IHDR" or zlib.crc32(b[:17]) != int.from_bytes(b[17:], "big"):
                return None  # a damaged IHDR: its size means nothing (the decoder refuses it)
            return int.from_bytes(b[8:12], "big"), int.from_bytes(b[4:8], "big")
        if fmt == "tiff":
            return _tiff_size(get)
        if fmt == "jpeg2000":
            s = _j2k_siz(get(0, 1 << 16))
            return None if s is None else (s["Ysiz"] - s["YOsiz"], s["Xsiz"] - s["XOsiz"])
        if fmt == "bmp":
            b = get(14, 12)
            if len(b) < 12:
                return None
            if int.from_bytes(b[0:4], "little") == 12:  # OS/2 BITMAPCOREHEADER
                return int.from_bytes(b[6:8], "little"), int.from_bytes(b[4:6], "little")
            w, h = struct.unpack("<ii", b[4:12])
            return abs(h), abs(w)
        if fmt == "webp":
            return _webp_size(get)
        if fmt == "pnm":
            return _pnm_size(get)
    except (struct.error, ValueError, IndexError):
        return None
    return None


# --- JPEG 2000 ---------------------------------------------------------------------------------

# main-header markers of a JPEG 2000 codestream (Part 1 and Part 15): CAP SIZ COD COC TLM PRF
# PLM CPF QCD QCC RGN POC PPM CRG COM
_J2K_MAIN = {0x50, 0x51, 0x52, 0x53, 0x55, 0x56, 0x57, 0x59, 0x5C, 0x5D, 0x5E, 0x5F, 0x60,
             0x63, 0x64}  # fmt: skip
_SIZ_FIELDS = ("Rsiz", "Xsiz", "Ysiz", "XOsiz", "YOsiz", "XTsiz", "YTsiz", "XTOsiz", "YTOsiz")
MAX_TILES = 65535  # Isot is 16 bits (tile indices 0..65534); OpenJPEG refuses more as well
MAX_COMPONENTS = 16384  # Csiz's range in ISO/IEC 15444-1
MAX_PRECISION = 38  # Ssiz's range: 1..38 bits per sample


def _j2k_siz(b: bytes):
    """The SIZ fields of the codestream in ``b`` (a raw codestream or a JP2's jp2c box), or
    None where no SOC + SIZ lies in it."""
    i = b.find(b"\xff\x4f\xff\x51")
    if i < 0 or i + 6 + 36 > len(b):
        return None
    seg = b[i + 6 : i + 6 + 36]
    vals = struct.unpack(">H8I", seg[:34])
    out = dict(zip(_SIZ_FIELDS, vals))
    out["Csiz"] = int.from_bytes(seg[34:36], "big")
    return out


def _siz_problem(seg: bytes, n: int) -> str | None:
    """What in a SIZ segment (``seg``: after its length field; ``n``: that length) cannot be
    valid: zero or inverted image and tile areas, tile sizes of 0 (a division by zero in the
    decoders' tile arithmetic: SIGFPE), tiles past the 32-bit canvas, more tiles than a
    codestream can index, and components of zero subsampling or impossible precision."""
    if len(seg) < 36:
        return f"SIZ segment of length {n}, too short"
    s = dict(zip(_SIZ_FIELDS, struct.unpack(">H8I", seg[:34])))
    comps = int.from_bytes(seg[34:36], "big")
    if not 1 <= comps <= MAX_COMPONENTS or n != 38 + 3 * comps:
        return f"SIZ: {comps} components, length {n}"
    xs, ys, xo, yo = s["Xsiz"], s["Ysiz"], s["XOsiz"], s["YOsiz"]
    xt, yt, xto, yto = s["XTsiz"], s["YTsiz"], s["XTOsiz"], s["YTOsiz"]
    if xs <= xo or ys <= yo:
        return f"SIZ: empty image area (Xsiz={xs}, XOsiz={xo}, Ysiz={ys}, YOsiz={yo})"
    if xt == 0 or yt == 0:
        return f"SIZ: tile size {xt}x{yt} (XTsiz x YTsiz; 0 is not a size)"
    if xto > xo or yto > yo or xto + xt <= xo or yto + yt <= yo:
        return (f"SIZ: the first tile misses the image (XTOsiz={xto}, YTOsiz={yto}, "
                f"XTsiz={xt}, YTsiz={yt}, XOsiz={xo}, YOsiz={yo})")  # fmt: skip
    if xto + xt > 0xFFFFFFFF or yto + yt > 0xFFFFFFFF:
        return f"SIZ: tile size {xt}x{yt} at offset {xto},{yto} overflows the 32-bit canvas"
    tiles = -(-(xs - xto) // xt) * -(-(ys - yto) // yt)
    if tiles > MAX_TILES:
        return f"SIZ: {tiles} tiles of {xt}x{yt} (at most {MAX_TILES})"
    for k in range(comps):
        ssiz, xr, yr = seg[36 + 3 * k : 39 + 3 * k]
        prec = (ssiz & 0x7F) + 1
        if prec > MAX_PRECISION:
            return f"SIZ: component {k} of {prec} bits (at most {MAX_PRECISION})"
        if xr == 0 or yr == 0:
            return f"SIZ: component {k} subsampled by {xr}x{yr} (0 is not a factor)"
    return None


def j2k_check(data) -> tuple[str | None, bool]:
    """``(problem, vouched)`` for a JPEG 2000 codestream's main header (SOC to the first tile):
    what in it cannot be valid (None: nothing), and whether the whole main header was walked
    to the first tile with SIZ, COD and QCD present and valid. Decoders have died with a
    signal on such headers (a tile size of 0: SIGFPE in the tile-count division; an unknown
    marker or a wrong segment length: OpenJPEG in OpenCV), so this runs before any decode;
    cheap (a walk over a few hundred bytes)."""
    b = bytes(data[: 1 << 16])
    i = b.find(b"\xff\x4f\xff\x51")  # SOC then SIZ (a raw codestream, or a JP2's jp2c box)
    if i < 0:
        return None, False  # no codestream header in the first 64 KiB: not vouched for
    at, levels, seen = i + 2, None, set()
    while at + 4 <= len(b):
        if b[at] != 0xFF:
            return f"the JPEG 2000 header is corrupt (no marker at byte {at})", False
        m = b[at + 1]
        if m == 0x90:  # the first tile: the main header ended cleanly
            return None, {0x51, 0x52, 0x5C} <= seen
        if m not in _J2K_MAIN:
            return f"the JPEG 2000 header is corrupt (unknown marker 0xFF{m:02X} at byte {at})", False
        n = int.from_bytes(b[at + 2 : at + 4], "big")
        seg = b[at + 4 : at + 2 + n]
        if n < 2 or at + 2 + n > len(b) and len(b) == len(data):
            return f"the JPEG 2000 header is corrupt (a segment length {n} at byte {at})", False
        if m == 0x51:
            if len(seg) < n - 2:  # cut by the 64 KiB window: not checked
                return None, False
            why = _siz_problem(seg, n)
            if why is not None:
                return f"the JPEG 2000 header is corrupt ({why})", False
        if m == 0x52 and len(seg) >= 10:
            levels = seg[5]
            if seg[1] > 4 or levels > 32 or seg[6] > 8 or seg[7] > 8 or seg[6] + seg[7] > 8:
                return "the JPEG 2000 header is corrupt (COD parameters out of range)", False
        if m == 0x5C and len(seg) >= 1 and levels is not None:
            style, k = seg[0] & 0x1F, 3 * levels + 1
            want = {0: 3 + k, 1: 5, 2: 3 + 2 * k}.get(style)
            if want != n:
                return f"the JPEG 2000 header is corrupt (QCD: style {style}, length {n})", False
        seen.add(m)
        at += 2 + n
    return None, False
