"""FLAC files the GPU-decoder tests write themselves: libFLAC (through soundfile) at several
compression levels and sample sizes, and FFmpeg's encoder (through PyAV) at its highest level,
which uses LPC orders up to 32, Rice2 partitions and stereo decorrelation modes."""

from __future__ import annotations

import os

import numpy as np


def _signals(rng, n, sr):
    t = np.arange(n) / sr
    f0 = 120 * (1 + 0.2 * np.sin(2 * np.pi * 0.5 * t))
    ph = 2 * np.pi * np.cumsum(f0) / sr
    speech = sum(np.sin(k * ph) / k for k in range(1, 20)) * 0.2
    speech *= 0.5 - 0.5 * np.cos(2 * np.pi * 3 * t)
    return {
        "speech": speech + 0.002 * rng.standard_normal(n),
        "noise": rng.uniform(-0.9, 0.9, n),  # no prediction helps: verbatim / escape codes
        "silence": np.zeros(n),  # constant subframes
        "ramp": np.linspace(-0.5, 0.5, n),  # fixed predictors
        "loud": np.clip(3 * np.sin(2 * np.pi * 440 * t), -1, 1),  # clipped square-ish wave
    }


def write_soundfile_cases(folder, *, seed=0):
    """libFLAC through soundfile: (path, description) pairs."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    out = []
    sr = 16000
    for kind, x in _signals(rng, 3 * sr + 123, sr).items():
        for subtype in ("PCM_16", "PCM_24", "PCM_S8"):
            for level in (0.0, 0.6, 1.0):
                p = os.path.join(folder, f"sf_{kind}_{subtype}_{level}.flac")
                sf.write(p, x.astype(np.float32), sr, subtype=subtype, format="FLAC",
                         compression_level=level)
                out.append(p)
    # stereo (left/side, right/side and mid/side are the encoder's choice per frame)
    x = _signals(rng, 2 * 44100 + 7, 44100)["speech"]
    st = np.stack([x, 0.6 * np.roll(x, 5) + 0.01 * rng.standard_normal(len(x))], axis=1)
    for subtype in ("PCM_16", "PCM_24"):
        p = os.path.join(folder, f"sf_stereo_{subtype}.flac")
        sf.write(p, st.astype(np.float32), 44100, subtype=subtype, format="FLAC")
        out.append(p)
    # samples that are all multiples of 256: "wasted bits" in every subframe
    q = np.round(_signals(rng, sr, sr)["speech"] * 127) / 128
    p = os.path.join(folder, "sf_wasted_bits.flac")
    sf.write(p, q.astype(np.float32), sr, subtype="PCM_16", format="FLAC")
    out.append(p)
    # shorter than one block, a single sample, and a rate with no header code
    for n, sr2 in ((100, 16000), (1, 16000), (4096 * 2 + 1, 11025)):
        p = os.path.join(folder, f"sf_short_{n}_{sr2}.flac")
        sf.write(p, (0.3 * rng.standard_normal(n)).astype(np.float32), sr2, subtype="PCM_16",
                 format="FLAC")
        out.append(p)
    return out


def _ffmpeg_flac(path, pcm, sr, options):
    """Encode int16 ``pcm`` ``[channels, n]`` with FFmpeg's FLAC encoder and ``options``."""
    import av

    layout = "mono" if pcm.shape[0] == 1 else "stereo"
    with av.open(path, "w", format="flac") as c:
        s = c.add_stream("flac", rate=sr, layout=layout)
        s.codec_context.options = dict(options)
        s.codec_context.format = "s16"
        step = 4096
        for i in range(0, pcm.shape[1], step):
            chunk = np.ascontiguousarray(pcm[:, i : i + step].T.reshape(1, -1))
            f = av.AudioFrame.from_ndarray(chunk, format="s16", layout=layout)
            f.sample_rate = sr
            f.pts = i
            for pkt in s.encode(f):
                c.mux(pkt)
        for pkt in s.encode(None):
            c.mux(pkt)


def write_ffmpeg_cases(folder, *, seed=1):
    """FFmpeg's FLAC encoder through PyAV, its options forcing each coding path in turn: LPC
    up to order 32, every fixed predictor order, every stereo decorrelation mode."""
    rng = np.random.default_rng(seed)
    out = []
    sr = 16000
    n = 2 * sr + 77
    x = _signals(rng, n, sr)["speech"]
    mono = np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)[None]
    cases = [("level12", mono, {"compression_level": "12"}),
             ("lpc32", mono, {"lpc_type": "levinson", "min_prediction_order": "32",
                              "max_prediction_order": "32"})]
    for order in range(5):
        cases.append((f"fixed{order}", mono, {"lpc_type": "fixed", "min_prediction_order":
                      str(order), "max_prediction_order": str(order)}))
    # stereo: a clean channel and a noisy copy, so that each mode has something to decorrelate
    noisy = np.clip(mono[0] + rng.integers(-300, 300, n), -32768, 32767).astype(np.int16)
    st = np.stack([mono[0], noisy])
    for mode in ("indep", "left_side", "right_side", "mid_side"):
        cases.append((f"stereo_{mode}", st, {"ch_mode": mode}))
    for name, pcm, opts in cases:
        p = os.path.join(folder, f"ff_{name}.flac")
        _ffmpeg_flac(p, pcm, sr, opts)
        out.append(p)
    p = os.path.join(folder, "handmade_variable.flac")
    write_handmade(p, mono[0, :9000])
    out.append(p)
    return out


class _BitWriter:
    def __init__(self):
        self.bits = []

    def put(self, value, n):
        for k in range(n - 1, -1, -1):
            self.bits.append((value >> k) & 1)

    def signed(self, value, n):
        self.put(value & ((1 << n) - 1), n)

    def rice(self, value, k):
        u = (-2 * value - 1) if value < 0 else 2 * value
        self.bits.extend([0] * (u >> k) + [1])
        self.put(u & ((1 << k) - 1), k)

    def align(self):
        self.bits.extend([0] * (-len(self.bits) % 8))

    def to_bytes(self):
        self.align()
        b = np.packbits(np.array(self.bits, np.uint8))
        return bytes(b)


def _crc(data, poly, width):
    top, mask, c = 1 << (width - 1), (1 << width) - 1, 0
    for byte in data:
        c ^= byte << (width - 8)
        for _ in range(8):
            c = ((c << 1) ^ poly) & mask if c & top else (c << 1) & mask
    return c


def _utf8_number(v):
    if v < 0x80:
        return bytes([v])
    n = 2
    while v >= 1 << (5 * n + 1):
        n += 1
    out = []
    for _ in range(n - 1):
        out.append(0x80 | (v & 0x3F))
        v >>= 6
    out.append(((0xFF00 >> n) & 0xFF) | v)
    return bytes(reversed(out))


def write_handmade(path, samples, sr=16000):
    """A mono 16-bit FLAC stream written here, bit by bit, for the coding paths the encoders
    above never choose: a variable-blocksize stream (frame headers carry sample numbers), odd
    block sizes, VERBATIM and CONSTANT subframes, and escaped (raw) residual partitions."""
    x = np.asarray(samples, np.int64)
    plan = [(1000, "verbatim"), (778, "escape"), (1, "verbatim"), (2048, "constant"),
            (334, "escape"), (333, "verbatim")]
    blocks, pos, k = [], 0, 0
    while pos < len(x):
        n, kind = plan[k % len(plan)]
        n = min(n, len(x) - pos)
        if kind == "escape" and n % 2:
            kind = "verbatim"
        blocks.append((pos, n, kind))
        pos += n
        k += 1
    frames = []
    for start, n, kind in blocks:
        seg = x[start : start + n]
        w = _BitWriter()
        w.put(0xFFF9, 16)  # sync, variable blocksize
        w.put(7, 4)  # block size: 16 bits at the end of the header
        w.put(0, 4)  # sample rate from STREAMINFO
        w.put(0, 4)  # mono
        w.put(4, 3)  # 16-bit
        w.put(0, 1)
        head = bytes(np.packbits(np.array(w.bits, np.uint8))) + _utf8_number(start)
        head += (n - 1).to_bytes(2, "big")
        head += bytes([_crc(head, 0x07, 8)])
        w = _BitWriter()
        if kind == "constant":
            seg = np.full(n, seg[0])
            x[start : start + n] = seg
        w.put(0, 1)
        if kind == "verbatim":
            w.put(1, 6)
            w.put(0, 1)
            for v in seg:
                w.signed(int(v), 16)
        elif kind == "constant":
            w.put(0, 6)
            w.put(0, 1)
            w.signed(int(seg[0]), 16)
        else:  # FIXED order 1; partition order 1: an escaped partition, then a Rice one
            w.put(9, 6)
            w.put(0, 1)
            w.signed(int(seg[0]), 16)
            res = np.diff(seg)
            w.put(0, 2)  # Rice, 4-bit parameters
            half = n // 2
            w.put(1, 4)
            w.put(15, 4)  # escape: raw residuals of 17 bits
            w.put(17, 5)
            for v in res[: half - 1]:
                w.signed(int(v), 17)
            w.put(9, 4)
            for v in res[half - 1 :]:
                w.rice(int(v), 9)
        body = w.to_bytes()
        frame = head + body
        frames.append(frame + _crc(frame, 0x8005, 16).to_bytes(2, "big"))
    info = _BitWriter()
    info.put(1, 16)  # min block size (the one-sample block)
    info.put(2048, 16)
    info.put(0, 24)
    info.put(0, 24)
    info.put(sr, 20)
    info.put(0, 3)
    info.put(15, 5)
    info.put(len(x), 36)
    meta = b"fLaC" + bytes([0x80, 0, 0, 34]) + info.to_bytes() + bytes(16)
    with open(path, "wb") as f:
        f.write(meta + b"".join(frames))
    return x


def reference(path):
    """libFLAC's samples as the batch loader returns them: float32, channels averaged."""
    import soundfile as sf

    x, _ = sf.read(path, dtype="float32", always_2d=True)
    return x[:, 0] if x.shape[1] == 1 else x.mean(axis=1)


def pack(paths, pad=64):
    """Files back to back in one uint8 buffer, as the loader lays them out."""
    blobs = [open(p, "rb").read() for p in paths]
    offsets = np.zeros(len(blobs) + 1, np.int64)
    offsets[1:] = np.cumsum([len(b) for b in blobs])
    buf = np.zeros(int(offsets[-1]) + pad, np.uint8)
    for b, o in zip(blobs, offsets):
        buf[o : o + len(b)] = np.frombuffer(b, np.uint8)
    return buf, offsets
