#!/usr/bin/env python3
"""CPU clips: avpipe's VideoDecoder against plain PyAV and torchcodec's exact mode.

Workload: 16-frame clips at stride 4 (frames s, s+4, ..., s+60) at seeded random starts, over 16
H.264 640x360 MP4 files with B-frames (:func:`benchmarks.data.cpu_clip_videos`: the same bytes
every time, cached in the data folder), decoded to uint8 RGB ``[16, 360, 640, 3]``. Each contender opens the file
for each clip, as a loader of random clips from many files does; per-file indexing that a loader
would do once (avpipe's scan cache, the PyAV contender's pts list) is warm before timing.

Contenders:

* ``avpipe``: ``VideoDecoder(path, device="cpu", threads=T).get_frames(indices)``.
* ``avpipe_default`` (only when named): the same with ``threads`` left unset.
* ``pyav``: seek to the clip's first frame (lands on the keyframe at or before it), decode forward
  to the clip's last frame, ``to_ndarray(format="rgb24")`` of the 16 wanted frames.
* ``torchcodec``: ``VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=T,
  dimension_order="NHWC").get_frames_at(indices)`` (its exact mode scans the file at each open).

Settings: ``1t`` one clip at a time, one decoder thread; ``2clip`` two clips at a time (two
Python threads), one decoder thread each; ``2ff`` one clip at a time, two FFmpeg threads
(frame + slice threading). A contender is named ``<decoder>@<setting>``. A warm-up pass per setting and contender decodes every
clip once and checks that every contender in every setting returns the same bytes for every
clip.

torchcodec runs where it imports (with FFmpeg libraries it can load: ``LD_LIBRARY_PATH``);
where it does not, the reason goes into the results' checks and the other contenders run.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import random
import time

from benchmarks import data as bdata

N_FRAMES = bdata.CLIP_VIDEO_FRAMES
CLIP_LEN, STRIDE = 16, 4
SETTINGS = {"1t": (1, 1), "2clip": (2, 1), "2ff": (1, 2)}  # name: (clip threads, decoder threads)

NAME = "cpu_clips"
SUITE = "cpu"
UNIT = "clips/s"
TITLE = ("16-frame clips at stride 4 over 16 H.264 640x360 files with B-frames, RGB, the file "
         "opened per clip, on the CPU; frames checked identical")
_WHAT = {"avpipe": "VideoDecoder(device=cpu, threads=T).get_frames",
         "avpipe_default": "VideoDecoder(device=cpu), threads unset",
         "pyav": "plain PyAV: seek to the keyframe, decode forward, rgb24",
         "torchcodec": "torchcodec VideoDecoder(seek_mode=exact, num_ffmpeg_threads=T)"}
_SET = {"1t": "one clip at a time, 1 decoder thread", "2clip": "2 clips at a time, 1 thread each",
        "2ff": "one clip at a time, 2 FFmpeg threads"}
CONTENDERS = {f"{d}@{s}": f"{w}; {_SET[s]}" for s in SETTINGS for d, w in _WHAT.items()}
OPTIONAL = tuple(c for c in CONTENDERS if c.startswith("avpipe_default@"))
RATIOS = [(f"avpipe@{s}", f"{a}@{s}") for a in ("pyav", "torchcodec") for s in SETTINGS]
PARAMS = {"clips": 32}
QUICK = {"clips": 4}
REQUIRES = ("av",)


def prepare(ctx):
    return {"paths": bdata.cpu_clip_videos(ctx.data_dir)}


def make_clips(paths, n_clips: int, seed: int = 0):
    rng = random.Random(seed)
    span = (CLIP_LEN - 1) * STRIDE
    return [(paths[k % len(paths)],
             list(range(s, s + CLIP_LEN * STRIDE, STRIDE)))
            for k, s in ((k, rng.randrange(N_FRAMES - span)) for k in range(n_clips))]


# -- contenders ------------------------------------------------------------------------------
_PTS: dict = {}  # per file, display-order pts (a loader indexes its files once)


def _pts(path):
    import av

    if path not in _PTS:
        with av.open(path) as c:
            _PTS[path] = sorted(p.pts for p in c.demux(c.streams.video[0]) if p.size)
    return _PTS[path]


def pyav_clip(path, idx, threads):
    import av
    import numpy as np

    pts = _pts(path)
    with av.open(path) as c:
        st = c.streams.video[0]
        st.thread_type = "AUTO" if threads > 1 else "SLICE"
        st.thread_count = threads
        want = {pts[i]: k for k, i in enumerate(idx)}
        out = [None] * len(idx)
        c.seek(pts[idx[0]], stream=st, backward=True, any_frame=False)
        for f in c.decode(st):
            k = want.get(f.pts)
            if k is not None:
                out[k] = f.to_ndarray(format="rgb24")
            if f.pts >= pts[idx[-1]]:
                break
    return np.stack(out)


def avpipe_clip(path, idx, threads):
    import avpipe

    with avpipe.VideoDecoder(path, device="cpu", threads=threads) as d:
        return d.get_frames(idx).data


def avpipe_default_clip(path, idx, threads):
    import avpipe

    with avpipe.VideoDecoder(path, device="cpu") as d:
        return d.get_frames(idx).data


def torchcodec_clip(path, idx, threads):
    from torchcodec.decoders import VideoDecoder

    d = VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=threads, device="cpu",
                     dimension_order="NHWC")
    return d.get_frames_at(indices=idx).data.numpy()


DECODERS = {"avpipe": avpipe_clip, "avpipe_default": avpipe_default_clip,
             "pyav": pyav_clip, "torchcodec": torchcodec_clip}


def run_clips(fn, clips, clip_threads, threads, digest=False):
    """Decode every clip; ``(seconds, digests or None)``."""
    def one(c):
        a = fn(c[0], c[1], threads)
        return hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest() if digest else None

    t0 = time.perf_counter()
    if clip_threads == 1:
        got = [one(c) for c in clips]
    else:
        with concurrent.futures.ThreadPoolExecutor(clip_threads) as ex:
            got = list(ex.map(one, clips))
    return time.perf_counter() - t0, (got if digest else None)



def _torchcodec():
    try:
        from torchcodec.decoders import VideoDecoder  # noqa: F401

        return None
    except Exception as e:  # noqa: BLE001 - reported, the other contenders still run
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


class Session:
    """Per-file indexing done before any timing; a warm-up pass per setting and decoder
    checks that every one returns the same bytes for every clip."""

    def __init__(self, ctx):
        import avpipe

        paths = ctx.data["paths"]
        self.clips = make_clips(paths, ctx.params["clips"])
        self.tc_unavailable = _torchcodec()
        for p in paths:
            avpipe.VideoDecoder(p, device="cpu").close()
            _pts(p)
        self.identical, self.mismatch, ref = True, [], None
        for s in SETTINGS:
            ct, th = SETTINGS[s]
            for n in ("avpipe", "pyav") + (() if self.tc_unavailable else ("torchcodec",)):
                _, dig = run_clips(DECODERS[n], self.clips, ct, th, digest=True)
                if ref is None:
                    ref = (f"{n}@{s}", dig)
                elif dig != ref[1]:
                    self.identical = False
                    bad = [k for k, (x, y) in enumerate(zip(dig, ref[1])) if x != y]
                    self.mismatch.append({"contender": f"{n}@{s}", "against": ref[0],
                                          "clips": bad[:8], "count": len(bad)})

    def measure(self, name):
        dec, s = name.split("@")
        if dec == "torchcodec" and self.tc_unavailable:
            raise RuntimeError(f"torchcodec unavailable: {self.tc_unavailable}")
        ct, th = SETTINGS[s]
        sec, _ = run_clips(DECODERS[dec], self.clips, ct, th)
        return len(self.clips) / sec, {"seconds": round(sec, 3), "clips": len(self.clips),
                                       "frames_identical": self.identical}

    def close(self):
        pass


_SESSION = {}


def session(ctx):
    sess = Session(ctx)
    _SESSION["last"] = sess
    return sess


def finish(ctx):
    sess = _SESSION.pop("last", None)
    if sess is None:
        return {}
    return {"frames_identical": sess.identical, "mismatches": sess.mismatch,
            "torchcodec_unavailable": sess.tc_unavailable}
