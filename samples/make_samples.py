#!/usr/bin/env python3
"""Regenerate avpipe's committed sample media, deterministically.

    python samples/make_samples.py            # (re)write samples/{speech,video,images}
    python samples/make_samples.py --check    # regenerate in memory, exit 1 if any file differs

What it makes (see samples/README.md for the full table):

* ``speech/``: six English utterances spoken by espeak-ng (voice ``en-us``), resampled to
  16 kHz mono, two each as WAV (PCM 16), FLAC and OGG (Vorbis), with a NeMo-style manifest
  ``speech/manifest.jsonl`` (audio_filepath relative to the manifest, duration, text).
* ``video/``: six 2 s synthetic clips (a moving circle or square over a drifting gradient) in
  H.264 MP4 (B-frames, GOP 15), HEVC MP4, VP8 WebM, VP9 WebM and MJPEG AVI; two carry an audio
  track (AAC, Opus). ``video/labels.csv`` lists path,label with the classes circles/squares.
* ``images/``: one synthetic scene as JPEG, PNG, TIFF (LZW) and JPEG 2000, plus a 16-bit
  grayscale PNG and a JPEG whose EXIF orientation is 6 (display rotated 90 degrees clockwise).

Determinism: all content comes from fixed seeds; encoders run single-threaded with FFmpeg's
``bitexact`` flags; the OGG stream serial number (random in libsndfile) is rewritten to a
fixed value. A file is only rewritten when its bytes change, so running this twice is a no-op.
Output bytes can still differ across encoder *versions* (x264, x265, libvpx, libopus, espeak-ng);
the committed files are the reference, this script is how they were made.

Generation-time tools: espeak-ng (``apt-get install espeak-ng``), PyAV, soundfile, scipy, PIL.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MAX_TOTAL_BYTES = 5 * 1024 * 1024
SR = 16000

# ---------------------------------------------------------------------------------------------
# speech
# ---------------------------------------------------------------------------------------------

ESPEAK_VOICE = "en-us"
ESPEAK_SPEED = 165  # words per minute
# (file name, sentence spoken); the manifest's text is the normalized sentence
UTTERANCES = [
    ("utt01.wav", "The quick brown fox jumps over the lazy dog."),
    ("utt02.wav", "Please call Stella and ask her to bring these things with her from the store."),
    ("utt03.flac", "Seven small boats sailed across the quiet harbor at dawn."),
    ("utt04.flac", "A rainbow appears when sunlight passes through drops of water in the air."),
    ("utt05.ogg", "Turn left at the next light, then keep going straight for two miles."),
    ("utt06.ogg", "Machine learning needs clean data, fast decoding, and a lot of patience."),
]


def _normalize_text(s: str) -> str:
    keep = "".join(c.lower() if (c.isalnum() or c in " '") else " " for c in s)
    return " ".join(keep.split())


def _espeak_version() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SystemExit(
            "espeak-ng is needed to regenerate the speech samples "
            "(apt-get install -y espeak-ng); the committed files are the reference"
        )
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().split("\n")[0].split("  Data at")[0].strip()


def _speak(text: str) -> np.ndarray:
    """espeak-ng -> float32 mono at 16 kHz, leading/trailing silence trimmed to 0.15 s."""
    import soundfile as sf
    from scipy.signal import resample_poly

    with tempfile.TemporaryDirectory() as d:
        wav = os.path.join(d, "s.wav")
        subprocess.run(
            ["espeak-ng", "-v", ESPEAK_VOICE, "-s", str(ESPEAK_SPEED), "-w", wav, text],
            check=True,
            capture_output=True,
        )
        x, sr = sf.read(wav, dtype="float64", always_2d=False)
    if x.ndim > 1:
        x = x.mean(axis=1)
    if sr != SR:
        from math import gcd

        g = gcd(SR, sr)
        x = resample_poly(x, SR // g, sr // g)
    # trim silence, keep 0.15 s margins
    loud = np.flatnonzero(np.abs(x) > 0.01)
    pad = int(0.15 * SR)
    if loud.size:
        x = x[max(0, loud[0] - pad) : loud[-1] + pad]
    x = 0.8 * x / max(1e-9, float(np.abs(x).max()))  # peak-normalize
    return x.astype(np.float32)


_CRC_TABLE = None


def _ogg_crc(data: bytes) -> int:
    global _CRC_TABLE
    if _CRC_TABLE is None:
        t = []
        for i in range(256):
            r = i << 24
            for _ in range(8):
                r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
            t.append(r & 0xFFFFFFFF)
        _CRC_TABLE = t
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC_TABLE[((crc >> 24) & 0xFF) ^ b]
    return crc


def _fix_ogg_serial(data: bytes, serial: int = 0x61767069) -> bytes:
    """Rewrite every page's stream serial number (libsndfile picks it from the clock)."""
    out = bytearray(data)
    pos = 0
    n_pages = 0
    while pos < len(out):
        if out[pos : pos + 4] != b"OggS":
            raise ValueError(f"not an Ogg page at byte {pos}")
        nseg = out[pos + 26]
        body = sum(out[pos + 27 : pos + 27 + nseg])
        end = pos + 27 + nseg + body
        struct.pack_into("<I", out, pos + 14, serial)
        struct.pack_into("<I", out, pos + 22, 0)
        struct.pack_into("<I", out, pos + 22, _ogg_crc(bytes(out[pos:end])))
        pos = end
        n_pages += 1
    if n_pages == 0:
        raise ValueError("no Ogg pages")
    return bytes(out)


def _encode_audio(x: np.ndarray, name: str) -> bytes:
    import soundfile as sf

    ext = name.rsplit(".", 1)[1]
    fmt, subtype = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS")}[ext]
    buf = io.BytesIO()
    sf.write(buf, x, SR, format=fmt, subtype=subtype)
    data = buf.getvalue()
    if ext == "ogg":
        data = _fix_ogg_serial(data)
    return data


def make_speech() -> dict[str, bytes]:
    import soundfile as sf

    files: dict[str, bytes] = {}
    lines = []
    for name, sentence in UTTERANCES:
        data = _encode_audio(_speak(sentence), name)
        info = sf.info(io.BytesIO(data))
        dur = info.frames / info.samplerate
        if not 2.0 <= dur <= 8.0:
            raise SystemExit(f"{name}: {dur:.2f} s is outside 2-8 s; shorten/lengthen the sentence")
        files[f"speech/{name}"] = data
        lines.append(
            json.dumps(
                {"audio_filepath": name, "duration": round(dur, 4), "text": _normalize_text(sentence)}
            )
        )
    files["speech/manifest.jsonl"] = ("\n".join(lines) + "\n").encode()
    return files


# ---------------------------------------------------------------------------------------------
# video
# ---------------------------------------------------------------------------------------------

W, H, FPS, SECONDS, GOP = 320, 240, 25, 2, 15

# (file, label, codec, container format, pixel format, audio codec or None, encoder options)
# x264 runs with no-mbtree: with mbtree on, its output changed from run to run here even with
# threads=1 (same input frames), which would break idempotency.
VIDEOS = [
    ("circles_h264.mp4", "circles", "libx264", "mp4", "yuv420p", "aac",
     {"x264-params": "keyint=15:min-keyint=15:scenecut=0:bframes=2:b-adapt=0:no-mbtree=1",
      "crf": "28", "preset": "medium", "threads": "1"}),
    ("squares_h264.mp4", "squares", "libx264", "mp4", "yuv420p", None,
     {"x264-params": "keyint=15:min-keyint=15:scenecut=0:bframes=2:b-adapt=0:no-mbtree=1",
      "crf": "28", "preset": "medium", "threads": "1"}),
    ("circles_hevc.mp4", "circles", "libx265", "mp4", "yuv420p", None,
     {"x265-params": "keyint=15:min-keyint=15:scenecut=0:bframes=2:pools=none:frame-threads=1:"
                     "wpp=0:log-level=error:info=0",
      "crf": "30", "preset": "fast"}),
    ("squares_vp8.webm", "squares", "libvpx", "webm", "yuv420p", "libopus",
     {"threads": "1", "deadline": "good", "cpu-used": "4", "b": "300k", "auto-alt-ref": "0",
      "keyint_min": "15"}),
    ("circles_vp9.webm", "circles", "libvpx-vp9", "webm", "yuv420p", None,
     {"threads": "1", "row-mt": "0", "deadline": "good", "cpu-used": "4", "crf": "34", "b": "0",
      "keyint_min": "15"}),
    ("squares_mjpeg.avi", "squares", "mjpeg", "avi", "yuvj420p", None,
     {"q:v": "6", "threads": "1"}),
]


def _frames(label: str, seed: int) -> np.ndarray:
    """[T, H, W, 3] uint8: a drifting color gradient and one moving shape (the class)."""
    rng = np.random.default_rng(seed)
    n = FPS * SECONDS
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    c0 = rng.uniform(40, 120, size=3)
    c1 = rng.uniform(120, 220, size=3)
    shape_color = rng.uniform(0, 255, size=3)
    r = rng.uniform(22, 36)
    x0, y0 = rng.uniform(50, W - 50), rng.uniform(50, H - 50)
    vx, vy = rng.choice([-1, 1]) * rng.uniform(40, 80), rng.choice([-1, 1]) * rng.uniform(20, 50)
    out = np.empty((n, H, W, 3), np.uint8)
    for t in range(n):
        s = t / FPS
        g = ((xx + 30 * s) / W * 0.7 + yy / H * 0.3) % 1.0
        img = c0 + (c1 - c0) * g[..., None]
        # reflect the center off the borders
        cx = abs(((x0 + vx * s - r) % (2 * (W - 2 * r))) - (W - 2 * r)) + r
        cy = abs(((y0 + vy * s - r) % (2 * (H - 2 * r))) - (H - 2 * r)) + r
        if label == "circles":
            mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
        else:
            mask = (np.abs(xx - cx) <= r * 0.9) & (np.abs(yy - cy) <= r * 0.9)
        img[mask] = shape_color
        out[t] = np.clip(img + 0.5, 0, 255).astype(np.uint8)
    return out


def _tone(seconds: float, rate: int, freq: float) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = 0.25 * np.sin(2 * np.pi * freq * t) + 0.08 * np.sin(2 * np.pi * 2 * freq * t)
    env = np.minimum(1.0, np.minimum(t, seconds - t) / 0.05)  # 50 ms fades
    return (x * env).astype(np.float32)


def _encode_video(name, label, codec, fmt, pix_fmt, audio_codec, opts, seed) -> bytes:
    import av

    frames = _frames(label, seed)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, name)
        with av.open(path, "w", format=fmt, container_options={"fflags": "+bitexact"}) as c:
            vs = c.add_stream(codec, rate=FPS)
            vs.width, vs.height, vs.pix_fmt = W, H, pix_fmt
            vs.time_base = Fraction(1, FPS)
            vs.codec_context.gop_size = GOP
            o = dict(opts)
            o["flags"] = "+bitexact"
            if codec == "mjpeg":
                # fixed quantizer
                vs.codec_context.qmin = vs.codec_context.qmax = int(o.pop("q:v"))
                vs.codec_context.flags |= av.codec.context.Flags.qscale
                vs.codec_context.global_quality = vs.codec_context.qmin * 118  # FF_QP2LAMBDA
            if "b" in o:
                vs.bit_rate = _bitrate(o.pop("b"))
            vs.options = o
            aus = None
            if audio_codec is not None:
                arate = 48000
                aus = c.add_stream(audio_codec, rate=arate)
                aus.layout = "mono"
                aus.options = {"flags": "+bitexact"}
                if audio_codec == "aac":
                    aus.bit_rate = 48000
                else:
                    aus.bit_rate = 32000
            for i, img in enumerate(frames):
                # Convert to the encoder's pixel format here and rebuild the frame from the
                # plain array: handing rgb24 frames to the encoder let uninitialized padding
                # bytes reach x264 (output changed from run to run).
                yuv = av.VideoFrame.from_ndarray(img, format="rgb24").reformat(format=pix_fmt)
                f = av.VideoFrame.from_ndarray(np.ascontiguousarray(yuv.to_ndarray()), format=pix_fmt)
                f.pts = i
                f.time_base = Fraction(1, FPS)
                for p in vs.encode(f):
                    c.mux(p)
            for p in vs.encode(None):
                c.mux(p)
            if aus is not None:
                x = _tone(SECONDS, 48000, 330.0 if label == "circles" else 523.25)
                fs = aus.codec_context.frame_size or 1024
                fmt_a = aus.codec_context.format.name
                for start in range(0, len(x), fs):
                    chunk = x[start : start + fs]
                    if len(chunk) < fs:
                        chunk = np.pad(chunk, (0, fs - len(chunk)))
                    af = av.AudioFrame.from_ndarray(
                        _audio_layout(chunk, fmt_a), format=fmt_a, layout="mono"
                    )
                    af.sample_rate = 48000
                    af.pts = start
                    af.time_base = Fraction(1, 48000)
                    for p in aus.encode(af):
                        c.mux(p)
                for p in aus.encode(None):
                    c.mux(p)
        with open(path, "rb") as fh:
            return fh.read()


def _audio_layout(chunk: np.ndarray, fmt: str) -> np.ndarray:
    if fmt in ("flt", "fltp"):  # mono: packed and planar are the same [1, n]
        return chunk[None, :]
    if fmt == "s16":
        return (np.clip(chunk, -1, 1) * 32767).astype(np.int16)[None, :]
    raise ValueError(f"unexpected audio sample format {fmt}")


def _bitrate(s: str) -> int:
    s = s.lower()
    if s.endswith("k"):
        return int(float(s[:-1]) * 1000)
    if s.endswith("m"):
        return int(float(s[:-1]) * 1_000_000)
    return int(s)


def make_videos() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    rows = ["path,label"]
    for seed, (name, label, codec, fmt, pix, acodec, opts) in enumerate(VIDEOS):
        files[f"video/{name}"] = _encode_video(name, label, codec, fmt, pix, acodec, opts, 100 + seed)
        rows.append(f"{name},{label}")
    files["video/labels.csv"] = ("\n".join(rows) + "\n").encode()
    return files


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------

IW, IH = 320, 240


def _scene(seed: int = 7) -> np.ndarray:
    """[IH, IW, 3] uint8: gradient sky, a sun, a few rectangles, mild noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:IH, 0:IW].astype(np.float32)
    img = np.empty((IH, IW, 3), np.float32)
    img[..., 0] = 60 + 120 * (yy / IH)
    img[..., 1] = 110 + 80 * (xx / IW)
    img[..., 2] = 230 - 90 * (yy / IH)
    sun = (xx - 250) ** 2 + (yy - 55) ** 2 <= 28**2
    img[sun] = (250, 220, 60)
    for _ in range(5):
        x0, y0 = rng.integers(0, IW - 60), rng.integers(120, IH - 30)
        w, h = rng.integers(20, 60), rng.integers(30, 100)
        img[y0 : y0 + h, x0 : x0 + w] = rng.uniform(20, 200, size=3)
    img += rng.normal(0, 3.0, size=img.shape)
    return np.clip(img + 0.5, 0, 255).astype(np.uint8)


def make_images() -> dict[str, bytes]:
    from PIL import Image, features

    rgb = Image.fromarray(_scene())
    files: dict[str, bytes] = {}

    def save(name, im, **kw):
        buf = io.BytesIO()
        im.save(buf, **kw)
        files[f"images/{name}"] = buf.getvalue()

    save("scene.jpg", rgb, format="JPEG", quality=90, optimize=False)
    save("scene.png", rgb, format="PNG", optimize=False, compress_level=9)
    save("scene.tif", rgb, format="TIFF", compression="tiff_lzw")
    if not features.check("jpg_2000"):
        raise SystemExit("PIL was built without OpenJPEG; cannot write the JPEG 2000 sample")
    save("scene.jp2", rgb, format="JPEG2000", irreversible=True, quality_mode="rates",
         quality_layers=[12])
    # 16-bit grayscale PNG: a smooth ramp using the full 0..65535 range
    yy, xx = np.mgrid[0:IH, 0:IW]
    ramp = ((xx / (IW - 1)) * 0.75 + (yy / (IH - 1)) * 0.25) * 65535
    g16 = Image.fromarray(np.round(ramp).astype(np.uint16))  # mode I;16
    save("gray16.png", g16, format="PNG", compress_level=9)
    # EXIF orientation 6: stored 320x240 (landscape), displayed 240x320 (rotated 90 deg CW)
    exif = Image.Exif()
    exif[0x0112] = 6
    save("exif_rotate6.jpg", rgb, format="JPEG", quality=90, exif=exif.tobytes())
    return files


# ---------------------------------------------------------------------------------------------


def build(espeak_info: dict) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    espeak_info["version"] = _espeak_version()
    files.update(make_speech())
    files.update(make_videos())
    files.update(make_images())
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE, help="output root (default: samples/)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate in memory and exit 1 if any committed file differs")
    args = ap.parse_args(argv)

    meta: dict = {}
    files = build(meta)
    total = sum(len(b) for b in files.values())
    changed = []
    for rel, data in sorted(files.items()):
        dst = args.out / rel
        old = dst.read_bytes() if dst.exists() else None
        if old != data:
            changed.append(rel)
            if not args.check:
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(dst.name + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, dst)
        print(f"{len(data):9d}  {rel}{'  (changed)' if old != data else ''}")
    print(f"{total:9d}  total ({total / 2**20:.2f} MiB) with {meta['version']}")
    if total > MAX_TOTAL_BYTES:
        print(f"error: samples total {total} bytes > {MAX_TOTAL_BYTES}", file=sys.stderr)
        return 1
    if args.check and changed:
        print(f"{len(changed)} file(s) differ from the committed samples", file=sys.stderr)
        return 1
    print("no changes" if not changed else f"{len(changed)} file(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
