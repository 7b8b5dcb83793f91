"""A seeded corpus of damaged media files for the reliability fuzz suite.

A few small clean *seed* files are encoded once per format (PyAV, soundfile, Pillow), then every
case is a cheap byte-level edit of a seed: truncation at a random point, bit flips in the header
or in the payload, zero length, header only, a wrong extension, zero frames / samples, absurd
dimensions, sample rates or channel counts (header fields patched), zeroed ranges, garbage after
the magic bytes, NaN / infinite samples (float WAV), audio header totals that lie (a WAV data
size past the end, a FLAC STREAMINFO count too small or too large, an Ogg stream cut inside a
page or with a bad-CRC page), a streamed FLAC (STREAMINFO count 0: valid, decoded whole),
JPEG 2000 tilings of tile size 0 (``tile_zero``) and other impossible or extreme SIZ tilings
(``tile_size``), and images declaring more pixels than the
pixel cap (``bomb``: PNG, JPEG, TIFF, JPEG 2000). The same ``seed`` gives the same bytes.

::

    python -m tests.fuzz.corpus --out /tmp/corpus --per-format 200 --seed 0

writes ``DIR/<family>/<case>.<ext>``, the clean seeds under ``DIR/seeds/`` and ``DIR/cases.json``
(one entry per case: ``id``, ``family``, ``kind``, ``path``, ``damage``, ``expect``, where
``expect`` is ``"good"`` for an untouched file and a valid variant (a FLAC streamed with no
sample count), ``"damaged"`` for damage every decoder must report (audio header totals that
lie: it is never decoded without a note or an error), ``"refused[:Class]"`` for a case every
decoder must refuse (:func:`damage`), and ``"bad"`` / ``"any"`` otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time
import zlib

import numpy as np

# family -> (kind, extension)
FAMILIES = {
    "h264_mp4": ("video", ".mp4"),
    "hevc_mp4": ("video", ".mp4"),
    "vp8_webm": ("video", ".webm"),
    "vp9_webm": ("video", ".webm"),
    "mjpeg_avi": ("video", ".avi"),
    "wav": ("audio", ".wav"),
    "wav_float": ("audio", ".wav"),
    "flac": ("audio", ".flac"),
    "ogg": ("audio", ".ogg"),
    "jpeg": ("image", ".jpg"),
    "png": ("image", ".png"),
    "tiff": ("image", ".tif"),
    "jp2": ("image", ".jp2"),
}

_VIDEO = {  # family -> (encoder, container format, pix_fmt, options)
    "h264_mp4": ("libx264", "mp4", "yuv420p",
                 {"preset": "ultrafast", "x264-params": "bframes=2:keyint=4:min-keyint=4:scenecut=0:threads=1"}),
    "hevc_mp4": ("libx265", "mp4", "yuv420p",
                 {"preset": "ultrafast",
                  "x265-params": "log-level=error:keyint=4:min-keyint=4:bframes=2:pools=1:frame-threads=1"}),
    "vp8_webm": ("libvpx", "webm", "yuv420p", {"deadline": "realtime", "cpu-used": "8", "g": "4"}),
    "vp9_webm": ("libvpx-vp9", "webm", "yuv420p",
                 {"deadline": "realtime", "cpu-used": "8", "g": "4", "row-mt": "0"}),
    "mjpeg_avi": ("mjpeg", "avi", "yuvj420p", {}),
}  # fmt: skip

SR = 16000
W, H, NF = 64, 48, 12  # seed video size and frame count


# --- clean seeds ---------------------------------------------------------------------------------


def _frame(i, w, h):
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    img = np.empty((h, w, 3), np.float32)
    img[..., 0] = 128 + 90 * np.sin(2 * np.pi * (x + 0.05 * i))
    img[..., 1] = 128 + 90 * np.cos(2 * np.pi * (y + 0.07 * i))
    img[..., 2] = 128 + 90 * np.sin(2 * np.pi * (x + y - 0.04 * i))
    s = 10
    img[(2 * i) % (h - s) : (2 * i) % (h - s) + s, (3 * i) % (w - s) : (3 * i) % (w - s) + s] = 240
    return np.clip(img, 0, 255).astype(np.uint8)


def _video(path, family, num_frames=NF):
    import av

    enc, fmt, pix, opts = _VIDEO[family]
    with av.open(path, "w", format=fmt) as out:
        st = out.add_stream(enc, rate=25)
        st.width, st.height, st.pix_fmt = W, H, pix
        st.options = dict(opts)
        if num_frames == 0:
            out.start_encoding()
        for i in range(num_frames):
            f = av.VideoFrame.from_ndarray(_frame(i, W, H), format="rgb24").reformat(format=pix)
            for pkt in st.encode(f):
                out.mux(pkt)
        if num_frames:
            for pkt in st.encode(None):
                out.mux(pkt)


def _signal(n):
    t = np.arange(n) / SR
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 1375 * t)).astype(
        np.float32
    )


def _audio(path, family, n=int(0.6 * SR)):
    import soundfile as sf

    x = _signal(n)
    if family == "wav":
        sf.write(path, x, SR, subtype="PCM_16", format="WAV")
    elif family == "wav_float":
        sf.write(path, x, SR, subtype="FLOAT", format="WAV")
    elif family == "flac":
        sf.write(path, x, SR, subtype="PCM_16", format="FLAC")
    else:
        sf.write(path, x, SR, format="OGG", subtype="VORBIS")


def _image(path, family):
    from PIL import Image

    rng = np.random.default_rng(7)
    a = _frame(3, 56, 40)
    a = np.clip(a.astype(int) + rng.integers(-8, 9, a.shape), 0, 255).astype(np.uint8)
    im = Image.fromarray(a)
    if family == "jpeg":
        im.save(path, "JPEG", quality=85)
    elif family == "png":
        im.save(path, "PNG")
    elif family == "tiff":
        im.save(path, "TIFF")
    else:
        try:
            im.save(path, "JPEG2000")
        except Exception:  # no OpenJPEG in this Pillow: the repository's sample
            here = os.path.dirname(os.path.abspath(__file__))
            with open(os.path.join(here, "..", "..", "samples", "images", "scene.jp2"), "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(data)


def make_seeds(folder) -> dict:
    """Encode the clean seeds: ``{family: path}``, plus ``{family + "_empty": path}`` for the
    zero-frame / zero-sample files of the video and audio families."""
    os.makedirs(folder, exist_ok=True)
    out = {}
    for fam, (kind, ext) in FAMILIES.items():
        p = os.path.join(folder, fam + ext)
        e = os.path.join(folder, fam + "_empty" + ext)
        if kind == "video":
            _video(p, fam)
            _video(e, fam, 0)
            out[fam + "_empty"] = e
        elif kind == "audio":
            _audio(p, fam)
            try:
                _audio(e, fam, 0)
                out[fam + "_empty"] = e
            except Exception:  # noqa: BLE001 - an encoder that cannot write 0 samples
                pass
        else:
            _image(p, fam)
        out[fam] = p
    return out


# --- where the header and the payload lie ---------------------------------------------------------


def _boxes(data, start=0, end=None):
    end = len(data) if end is None else end
    out, i = [], start
    while i + 8 <= end:
        size = struct.unpack(">I", data[i : i + 4])[0]
        typ = bytes(data[i + 4 : i + 8])
        if size == 1 and i + 16 <= end:
            size = struct.unpack(">Q", data[i + 8 : i + 16])[0]
        if size < 8:
            break
        out.append((typ, i, min(i + size, end)))
        i += size
    return out


def spans(family, data):
    """``(header, payload)``: two (start, end) byte ranges of a clean file."""
    n = len(data)
    if family.endswith("_mp4"):
        bx = {t: (a, b) for t, a, b in _boxes(data)}
        head = bx.get(b"moov", (0, min(n, 64)))
        a, b = bx.get(b"mdat", (head[1], n))
        return head, (a + 8, b)
    if family.endswith("_webm"):
        c = data.find(b"\x1f\x43\xb6\x75")
        return (0, c), (c, n)
    if family == "mjpeg_avi":
        m = data.find(b"movi")
        i = data.find(b"idx1")
        return (0, m), (m + 4, i if i > 0 else n)
    if family.startswith("wav"):
        d = data.find(b"data")
        return (0, d + 8), (d + 8, n)
    if family == "flac":
        i = 4
        while True:
            last, ln = data[i] & 0x80, int.from_bytes(data[i + 1 : i + 4], "big")
            i += 4 + ln
            if last:
                break
        return (0, i), (i, n)
    if family == "ogg":
        k, at = 0, -1
        for _ in range(3):
            at = data.find(b"OggS", at + 1)
            k += 1
        return (0, at), (at, n)
    if family == "jpeg":
        s = data.find(b"\xff\xda")
        ln = int.from_bytes(data[s + 2 : s + 4], "big")
        return (0, s + 2 + ln), (s + 2 + ln, n - 2)
    if family == "png":
        i = data.find(b"IDAT") - 4
        e = data.find(b"IEND") - 4
        return (0, i), (i + 8, e)
    if family == "tiff":
        bo = "<" if data[:2] == b"II" else ">"
        ifd = struct.unpack(bo + "I", data[4:8])[0]
        cnt = struct.unpack(bo + "H", data[ifd : ifd + 2])[0]
        end = ifd + 2 + 12 * cnt + 4
        if ifd > 8:  # strips first, IFD last
            return (ifd, end), (8, ifd)
        return (0, end), (end, n)
    if family == "jp2":
        s = data.find(b"\xff\x90")
        return (0, s), (s, n)
    raise ValueError(family)


# --- damage --------------------------------------------------------------------------------------


def _flip(data, lo, hi, k, rng):
    b = bytearray(data)
    lo, hi = max(0, lo), min(len(b), hi)
    if hi <= lo:
        lo, hi = 0, len(b)
    for _ in range(k):
        i = int(rng.integers(lo, hi))
        b[i] ^= 1 << int(rng.integers(0, 8))
    return bytes(b)


def _ogg_crc(page: bytes) -> int:
    """The Ogg page checksum (one implementation: the samples' generator's)."""
    import importlib.util
    import sys

    mod = sys.modules.get("avpipe_make_samples")
    if mod is None:
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(
            "avpipe_make_samples", os.path.join(here, "..", "..", "samples", "make_samples.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["avpipe_make_samples"] = mod
        spec.loader.exec_module(mod)
    return mod._ogg_crc(page)


def _ogg_fix_first_page(b: bytearray):
    nseg = b[26]
    size = 27 + nseg + sum(b[27 : 27 + nseg])
    page = bytearray(b[:size])
    page[22:26] = b"\0\0\0\0"
    b[22:26] = struct.pack("<I", _ogg_crc(bytes(page)))


def _put(b, at, fmt, value):
    if 0 <= at and at + struct.calcsize(fmt) <= len(b):
        struct.pack_into(fmt, b, at, value)


def absurd(family, data, rng):
    """Patch one header field to an absurd value: ``(bytes, what)``."""
    b = bytearray(data)
    big = [0, 1, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1_000_000]
    pick = int(rng.integers(0, 1 << 30))
    if family.startswith("wav"):
        fields = [("sample_rate", 24, "<I", [0, 1, 7, 0xFFFFFFFF, 4_000_000_000]),
                  ("channels", 22, "<H", [0, 1024, 0xFFFF]),
                  ("bits", 34, "<H", [0, 7, 64, 0xFFFF]),
                  ("block_align", 32, "<H", [0, 0xFFFF]),
                  ("data_size", data.find(b"data") + 4, "<I", [0xFFFFFFFF, 2 * len(data), 0, 3]),
                  ("riff_size", 4, "<I", [0, 0xFFFFFFFF])]  # fmt: skip
        name, at, fmt, vals = fields[pick % len(fields)]
        v = vals[(pick // 7) % len(vals)]
        _put(b, at, fmt, v)
        return bytes(b), f"{name}={v}"
    if family == "flac":
        bits = int.from_bytes(b[18:26], "big")  # sr[20] ch-1[3] bps-1[5] total[36]
        which = pick % 5
        if which == 0:
            v = [0, 1, 0xFFFFF][(pick // 5) % 3]
            bits = (bits & ~(0xFFFFF << 44)) | (v << 44)
            what = f"sample_rate={v}"
        elif which == 1:
            bits |= 7 << 41
            what = "channels=8"
        elif which == 2:
            bits = (bits & ~(0x1F << 36)) | (31 << 36)
            what = "bits_per_sample=32"
        elif which == 3:
            v = [(1 << 36) - 1, 0, 10 * SR * 60][(pick // 5) % 3]
            bits = (bits & ~((1 << 36) - 1)) | v
            what = f"total_samples={v}"
        else:
            _put(b, 8, ">H", [0, 0xFFFF][(pick // 5) % 2])
            _put(b, 10, ">H", [0, 0xFFFF, 16][(pick // 11) % 3])
            return bytes(b), "block_size"
        b[18:26] = bits.to_bytes(8, "big")
        return bytes(b), what
    if family == "ogg":
        at = 27 + b[26] + 7  # the Vorbis identification header, after "\x01vorbis"
        which = pick % 3
        if which == 0:
            v = [0, 255][(pick // 3) % 2]
            b[at + 4] = v
            what = f"channels={v}"
        elif which == 1:
            v = [0, 1, 0xFFFFFFFF][(pick // 3) % 3]
            _put(b, at + 5, "<I", v)
            what = f"sample_rate={v}"
        else:
            b[at + 4 + 1 + 4 + 12] = [0x00, 0xFF, 0xEE][(pick // 3) % 3]
            what = "block_sizes"
        if (pick // 97) % 4:  # mostly a valid CRC, so that the field itself is read
            _ogg_fix_first_page(b)
        return bytes(b), what
    if family == "png":
        which = pick % 3
        if which == 0:
            v = big[(pick // 3) % len(big)]
            _put(b, 16, ">I", v)
            _put(b, 20, ">I", [v, 40, 0x7FFFFFFF][(pick // 17) % 3])
            what = f"width={v}"
        elif which == 1:
            b[24] = [0, 3, 99][(pick // 3) % 3]
            what = f"bit_depth={b[24]}"
        else:
            b[25] = [1, 5, 99][(pick // 3) % 3]
            what = f"color_type={b[25]}"
        if (pick // 101) % 4:
            _put(b, 29, ">I", zlib.crc32(bytes(b[12:29])) & 0xFFFFFFFF)
        return bytes(b), what
    if family in ("jpeg", "mjpeg_avi"):
        s = max(b.find(b"\xff\xc0"), b.find(b"\xff\xc2"))
        if family == "mjpeg_avi" and pick % 2:
            a = b.find(b"avih")
            which = (pick // 2) % 3
            if which == 0:
                _put(b, a + 8 + 32, "<I", 0xFFFFFFFF)
                _put(b, a + 8 + 36, "<I", 0xFFFFFFFF)
                return bytes(b), "avih_dims"
            if which == 1:
                _put(b, a + 8 + 16, "<I", [0, 0xFFFFFFFF][(pick // 6) % 2])
                return bytes(b), "avih_total_frames"
            f = b.find(b"strf")
            _put(b, f + 12, "<i", [0, -(1 << 31), 1 << 30][(pick // 6) % 3])
            return bytes(b), "strf_width"
        which = (pick // 2) % 3
        if which == 0:
            v = [0, 0xFFFF][(pick // 6) % 2]
            _put(b, s + 5, ">H", v)
            _put(b, s + 7, ">H", [v, 0xFFFF, 0][(pick // 12) % 3])
            return bytes(b), f"sof_dims={v}"
        if which == 1:
            b[s + 9] = [0, 2, 255][(pick // 6) % 3]
            return bytes(b), f"components={b[s + 9]}"
        b[s + 4] = [0, 16, 12][(pick // 6) % 3]
        return bytes(b), f"precision={b[s + 4]}"
    if family == "tiff":
        bo = "<" if data[:2] == b"II" else ">"
        ifd = struct.unpack(bo + "I", data[4:8])[0]
        cnt = struct.unpack(bo + "H", data[ifd : ifd + 2])[0]
        tags = {256: "width", 257: "height", 258: "bits", 277: "samples", 273: "strip_offsets",
                279: "strip_bytes", 259: "compression"}  # fmt: skip
        entries = []
        for k in range(cnt):
            e = ifd + 2 + 12 * k
            tag, typ, num = struct.unpack(bo + "HHI", data[e : e + 8])
            if tag in tags:
                entries.append((tag, typ, num, e))
        tag, typ, num, e = entries[pick % len(entries)]
        v = [0, 0xFFFF, 0xFFFFFFFF, 12345][(pick // 11) % 4]
        if typ == 3 and num <= 2:
            _put(b, e + 8, bo + "H", v & 0xFFFF)
        else:
            _put(b, e + 8, bo + "I", v)
        return bytes(b), f"{tags[tag]}={v}"
    if family == "jp2":
        which = pick % 3
        if which == 0:
            i = b.find(b"ihdr")
            _put(b, i + 4, ">I", big[(pick // 3) % len(big)])
            _put(b, i + 8, ">I", big[(pick // 7) % len(big)])
            return bytes(b), "ihdr_dims"
        s = b.find(b"\xff\x51")
        if which == 1:
            _put(b, s + 6, ">I", big[(pick // 3) % len(big)])
            _put(b, s + 10, ">I", big[(pick // 7) % len(big)])
            return bytes(b), "siz_dims"
        _put(b, s + 38, ">H", [0, 0x4000, 0xFFFF][(pick // 3) % 3])
        return bytes(b), "siz_components"
    if family.endswith("_mp4"):
        which = pick % 5
        if which == 0:
            for tag in (b"avc1", b"hvc1", b"hev1"):
                i = b.find(tag)
                if i > 0:
                    _put(b, i + 28, ">H", [0, 0xFFFF, 1][(pick // 5) % 3])
                    _put(b, i + 30, ">H", [0, 0xFFFF, 1][(pick // 13) % 3])
                    break
            return bytes(b), "sample_entry_dims"
        if which == 1:
            i = b.find(b"tkhd") - 4
            _put(b, i + 84, ">I", 0xFFFF0000)
            _put(b, i + 88, ">I", 0xFFFF0000)
            return bytes(b), "tkhd_dims"
        if which == 2:
            i = b.find(b"stsz")
            _put(b, i + 12, ">I", [0xFFFFFFFF, 0, 1][(pick // 5) % 3])
            return bytes(b), "stsz_count"
        if which == 3:
            i = b.find(b"mdhd")
            _put(b, i + 16, ">I", [0, 1, 0xFFFFFFFF][(pick // 5) % 3])
            return bytes(b), "mdhd_timescale"
        i = b.find(b"stts")
        _put(b, i + 12, ">I", [0xFFFFFFFF, 0][(pick // 5) % 2])
        return bytes(b), "stts_count"
    if family.endswith("_webm"):
        which = pick % 3
        if which == 0 and family == "vp8_webm":
            i = b.find(b"\x9d\x01\x2a")
            _put(b, i + 3, "<H", 0x3FFF)
            _put(b, i + 5, "<H", 0x3FFF)
            return bytes(b), "vp8_keyframe_dims"
        if which <= 1:
            for el in (b"\xb0\x81", b"\xba\x81"):
                i = b.find(el, b.find(b"\x16\x54\xae\x6b"))
                if i > 0:
                    b[i + 2] = [0, 0xFF][(pick // 3) % 2]
            return bytes(b), "pixel_dims"
        i = b.find(b"\x44\x89")  # Duration
        if i > 0 and b[i + 2] == 0x88:
            _put(b, i + 3, ">d", [float("nan"), 1e300, -5.0, 0.0][(pick // 3) % 4])
        return bytes(b), "duration"
    return _flip(data, 0, 64, 2, rng), "flip"


def _nan_samples(data, rng):
    (h0, h1), (p0, p1) = spans("wav_float", data)
    b = bytearray(data)
    k = int(rng.integers(1, 6))
    for _ in range(k):
        i = p0 + 4 * int(rng.integers(0, (p1 - p0) // 4))
        b[i : i + 4] = struct.pack("<f", [float("nan"), float("inf"), -float("inf")][_ % 3])
    return bytes(b)


def _siz(b, field, value):
    """Set a JPEG 2000 SIZ field (offsets from the SIZ marker)."""
    at = {"Xsiz": 6, "Ysiz": 10, "XOsiz": 14, "YOsiz": 18, "XTsiz": 22, "YTsiz": 26,
          "XTOsiz": 30, "YTOsiz": 34}[field]  # fmt: skip
    _put(b, b.find(b"\xff\x51") + at, ">I", value)


TILE_ZERO = [  # a tile size of 0: a division by zero in decoders (SIGFPE)
    ("tile_w0", {"XTsiz": 0}, "refused"),
    ("tile_h0", {"YTsiz": 0}, "refused"),
    ("tile_00", {"XTsiz": 0, "YTsiz": 0}, "refused"),
]  # fmt: skip
TILE_OTHER = [
    ("tiles_65536+", {"Xsiz": 1 << 17, "Ysiz": 1 << 17, "XTsiz": 1, "YTsiz": 1}, "refused"),
    ("tile_offset_past_image", {"XTOsiz": 1 << 20}, "refused"),
    ("tile_huge", {"XTsiz": 0xFFFFFFFF, "YTsiz": 0xFFFFFFFF}, "any"),
    ("tile_1x1", {"XTsiz": 1, "YTsiz": 1}, "any"),
]  # fmt: skip


def tile_size(data, rng, variants):
    """A JPEG 2000 with its SIZ tiling patched (one of ``variants``): ``(bytes, what,
    expect)``. A tile size of 0, more tiles than a codestream can index, or a first tile
    missing the image must be refused with a typed error (``expect="refused"``); one tile
    larger than the image and 1x1 tiles are valid (``"any"``). Half the cases are the raw
    codestream (the JP2's ``jp2c`` box content, still named ``.jp2``)."""
    raw = bool(rng.integers(0, 2))
    if raw:
        c = data.find(b"jp2c")
        data = data[c + 4 :] if c >= 0 else data
    b = bytearray(data)
    name, fields, expect = variants[int(rng.integers(0, len(variants)))]
    for k, v in fields.items():
        _siz(b, k, v)
    return bytes(b), f"{name} {'raw' if raw else 'jp2'}", expect


_BOMBS: dict = {}


def png_bomb(w, h):
    """A gray PNG of ``w`` x ``h`` zeros: a few hundred KB that decode to ``w * h`` bytes."""
    if (w, h) not in _BOMBS:
        comp = zlib.compressobj(9)
        rows = (b"\x00" + bytes(w)) * 250
        body = b"".join(comp.compress(rows) for _ in range(h // 250)) + comp.flush()

        def chunk(t, d):
            return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

        _BOMBS[w, h] = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0,
                        0, 0)) + chunk(b"IDAT", body) + chunk(b"IEND", b""))  # fmt: skip
    return _BOMBS[w, h]


BOMB_SIDE = 20000  # 400 Mpx: over avpipe's default pixel cap (178,956,970)


def bomb(family, data, rng):
    """An image whose header declares ``BOMB_SIDE`` squared pixels (or more), to be refused by
    the pixel cap before decoding: ``(bytes, what)``. PNG: a real bomb (zeros, consistent
    data); JPEG, TIFF, JPEG 2000: the clean seed with its size fields patched."""
    n = BOMB_SIDE + int(rng.integers(0, 40000))
    b = bytearray(data)
    if family == "png":
        return png_bomb(BOMB_SIDE, BOMB_SIDE), f"{BOMB_SIDE}x{BOMB_SIDE} zeros"
    if family == "jpeg":
        s = max(b.find(b"\xff\xc0"), b.find(b"\xff\xc2"))
        n = min(n, 0xFFFF)
        _put(b, s + 5, ">H", n)
        _put(b, s + 7, ">H", n)
    elif family == "tiff":
        bo = "<" if data[:2] == b"II" else ">"
        ifd = struct.unpack(bo + "I", data[4:8])[0]
        cnt = struct.unpack(bo + "H", data[ifd : ifd + 2])[0]
        for k in range(cnt):
            e = ifd + 2 + 12 * k
            tag, typ, num = struct.unpack(bo + "HHI", data[e : e + 8])
            if tag in (256, 257):
                _put(b, e + 8, bo + ("H" if typ == 3 else "I"), min(n, 0xFFFF))
        n = min(n, 0xFFFF)
    else:  # jp2: the image and its one tile (a valid tiling), and the ihdr box
        for k in ("Xsiz", "Ysiz", "XTsiz", "YTsiz"):
            _siz(b, k, n)
        i = b.find(b"ihdr")
        if i >= 0:
            _put(b, i + 4, ">I", n)
            _put(b, i + 8, ">I", n)
    return bytes(b), f"{n}x{n}"


# which families take a damage kind (the others: every family)
ONLY = {"nan": {"wav_float"}, "tile_zero": {"jp2"}, "tile_size": {"jp2"},
        "bomb": {"png", "jpeg", "tiff", "jp2"},
        "header_lies": {"wav", "wav_float", "flac", "ogg"}, "streamed": {"flac"}}

DAMAGES = (
    "truncate",
    "truncate_tail",
    "flip_header",
    "flip_payload",
    "zero_length",
    "header_only",
    "wrong_extension",
    "zero_frames",
    "absurd",
    "zero_fill",
    "magic_garbage",
    "flip_many",
    "nan",
    "header_lies",
    "streamed",
    "tile_zero",
    "tile_size",
    "bomb",
)


def _flac_total(data: bytes, total: int) -> bytes:
    """FLAC bytes with STREAMINFO's sample count set to ``total`` (0: unknown, as FFmpeg writes
    a stream to a pipe)."""
    b = bytearray(data)
    v = int.from_bytes(b[18:26], "big")
    b[18:26] = ((v & ~((1 << 36) - 1)) | total).to_bytes(8, "big")
    return bytes(b)


def _header_lies(family, data, rng):
    """A header whose length says more (or, for FLAC, also fewer) samples than the file holds:
    ``(bytes, detail)``. WAV: the data chunk's size past the file's end; FLAC: STREAMINFO's
    count too small or too large; Ogg: the stream cut inside its audio, or one audio page with
    a bad CRC (its samples skipped by the decoder)."""
    b = bytearray(data)
    if family.startswith("wav"):
        d = data.find(b"data")
        have = len(data) - (d + 8)
        more = int(have * rng.uniform(0.1, 2.0)) // 4 * 4 + 4
        _put(b, d + 4, "<I", have + more)
        return bytes(b), f"data_size+{more}"
    if family == "flac":
        total = int.from_bytes(data[18:26], "big") & ((1 << 36) - 1)
        if rng.integers(0, 2):
            t = int(rng.integers(1, total // 2))
            return _flac_total(data, t), f"total={t}/{total}"
        t = total + int(rng.integers(4096, total + 4097))
        return _flac_total(data, t), f"total={t}/{total}"
    pages = [i for i in range(len(data) - 4) if data[i : i + 4] == b"OggS"]
    audio = pages[2:] or pages[-1:]
    if rng.integers(0, 2):
        a = audio[int(rng.integers(0, len(audio)))]
        at = int(rng.integers(a + 28, min(len(data), a + 400)))
        return data[:at], f"cut_in_page_at={at}/{len(data)}"
    a = audio[int(rng.integers(0, len(audio)))]
    at = a + 27 + data[a + 26] + int(rng.integers(0, 16))  # a payload byte of that page
    b[at] ^= 0xFF
    return bytes(b), f"bad_crc_page_at={a}"


def damage(family, data, kind, rng, seeds, empty=None):
    """One damaged variant: ``(bytes, detail, extension or None, expect)``. ``expect``:
    ``"bad"`` (should not decode), ``"any"``, or ``"refused"`` / ``"refused:<ErrorClass>"``
    (must come back as a typed error, of that class: the harness fails it otherwise)."""
    if kind in ("tile_zero", "tile_size") and family == "jp2":
        b, what, expect = tile_size(data, rng, TILE_ZERO if kind == "tile_zero" else TILE_OTHER)
        return b, what, None, "refused:CorruptDataError" if expect == "refused" else expect
    if kind == "bomb" and family in ONLY["bomb"]:
        b, what = bomb(family, data, rng)
        return b, what, None, "refused:ImageTooLargeError"
    (h0, h1), (p0, p1) = spans(family, data)
    n = len(data)
    if kind == "truncate":
        at = int(rng.integers(1, n))
        return data[:at], f"at={at}/{n}", None, "bad"
    if kind == "truncate_tail":
        at = int(n * rng.uniform(0.6, 0.995))
        return data[:at], f"at={at}/{n}", None, "bad"
    if kind == "flip_header":
        k = int(rng.integers(1, 5))
        return _flip(data, h0, h1, k, rng), f"bits={k}", None, "any"
    if kind == "flip_payload":
        k = int(rng.integers(1, 17))
        return _flip(data, p0, p1, k, rng), f"bits={k}", None, "any"
    if kind == "flip_many":
        k = int(rng.integers(16, 200))
        return _flip(data, 0, n, k, rng), f"bits={k}", None, "any"
    if kind == "zero_length":
        return b"", "", None, "bad"
    if kind == "header_only":
        return data[:h1], f"bytes={h1}", None, "bad"
    if kind == "wrong_extension":
        others = sorted(f for f in seeds if not f.endswith("_empty") and f != family)
        other = others[int(rng.integers(0, len(others)))]
        with open(seeds[other], "rb") as f:
            return f.read(), f"content={other}", None, "any"
    if kind == "zero_frames" and family == "flac":  # STREAMINFO saying 0 samples, no frames
        b = bytearray(data[:h1])
        bits = int.from_bytes(b[18:26], "big") & ~((1 << 36) - 1)
        b[18:26] = bits.to_bytes(8, "big")
        return bytes(b), "", None, "bad"
    if kind == "zero_frames" and empty:
        return empty, "", None, "bad"
    if kind == "nan" and family == "wav_float":
        return _nan_samples(data, rng), "", None, "bad"
    if kind == "header_lies":  # damage a decoder can tell: never decoded without a report
        b, what = _header_lies(family, data, rng)
        return b, what, None, "damaged"
    if kind == "streamed" and family == "flac":  # a valid stream written to a pipe
        return _flac_total(data, 0), "total=0", None, "good"
    if kind in ("absurd", "zero_frames", "nan"):
        b, what = absurd(family, data, rng)
        return b, what, None, "any"
    if kind == "zero_fill":
        a = int(rng.integers(p0, max(p0 + 1, p1)))
        k = int(rng.integers(16, 512))
        b = bytearray(data)
        b[a : a + k] = bytes(len(b[a : a + k]))
        return bytes(b), f"at={a} len={k}", None, "any"
    if kind == "magic_garbage":
        keep = 16 if family not in ("mjpeg_avi",) else 12
        junk = rng.integers(0, 256, int(rng.integers(16, 4096)), dtype=np.uint8).tobytes()
        return data[:keep] + junk, "", None, "bad"
    raise ValueError(kind)


def generate(out, *, per_format: int = 200, seed: int = 0, families=None) -> list[dict]:
    """Write the corpus under ``out``; returns the cases (also written to ``out/cases.json``).
    Every family's first case is its clean seed (``expect="good"``)."""
    out = os.fspath(out)
    seeds = make_seeds(os.path.join(out, "seeds"))
    cases = []
    fams = list(FAMILIES) if families is None else list(families)
    for fi, fam in enumerate(fams):
        kind, ext = FAMILIES[fam]
        folder = os.path.join(out, fam)
        os.makedirs(folder, exist_ok=True)
        with open(seeds[fam], "rb") as f:
            clean = f.read()
        empty = None
        if fam + "_empty" in seeds:
            with open(seeds[fam + "_empty"], "rb") as f:
                empty = f.read()
        rng = np.random.default_rng([seed, fi])
        kinds = [d for d in DAMAGES if d not in ONLY or fam in ONLY[d]]
        for i in range(per_format):
            if i == 0:
                data, detail, dmg, expect = clean, "", "clean", "good"
            else:
                dmg = kinds[(i - 1) % len(kinds)]
                data, detail, _, expect = damage(fam, clean, dmg, rng, seeds, empty)
            cid = f"{fam}-{i:04d}"
            path = os.path.join(folder, f"{cid}-{dmg}{ext}")
            with open(path, "wb") as f:
                f.write(data)
            cases.append(dict(id=cid, family=fam, kind=kind, path=path, damage=dmg,
                              detail=detail, expect=expect))  # fmt: skip
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"seed": seed, "per_format": per_format, "seeds": seeds, "cases": cases}, f,
                  indent=1)  # fmt: skip
    return cases


def blocking_cases(out, families=("wav", "h264_mp4")) -> list[dict]:
    """``blocking_read`` cases: per family a named pipe with its extension, under ``out``.
    Nothing writes to them, so a read never returns (as on a stalled network mount); the fuzz
    worker running them takes pipes for regular files (``harness.BLOCKING_FEEDS`` feeds only:
    a decoder called directly would block its caller for good)."""
    out = os.fspath(out)
    cases = []
    for fam in families:
        kind, ext = FAMILIES[fam]
        folder = os.path.join(out, fam)
        os.makedirs(folder, exist_ok=True)
        cid = f"{fam}-blocking"
        path = os.path.join(folder, f"{cid}-blocking_read{ext}")
        if not os.path.exists(path):
            os.mkfifo(path)
        cases.append(dict(id=cid, family=fam, kind=kind, path=path, damage="blocking_read",
                          detail="a named pipe nothing writes to", expect="bad"))
    return cases


def load(out) -> dict:
    with open(os.path.join(os.fspath(out), "cases.json")) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-format", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases = generate(a.out, per_format=a.per_format, seed=a.seed)
    counts: dict = {}
    for c in cases:
        counts[c["family"]] = counts.get(c["family"], 0) + 1
    for k, v in counts.items():
        print(f"{k:12s} {v}")
    print(f"{len(cases)} cases in {time.perf_counter() - t0:.1f} s -> {a.out}")


if __name__ == "__main__":
    main()

