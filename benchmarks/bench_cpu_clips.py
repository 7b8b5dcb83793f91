#!/usr/bin/env python3
"""CPU clips: avpipe's VideoDecoder against plain PyAV and torchcodec's exact mode.

    python3 benchmarks/bench_cpu_clips.py [--rounds 3] [--clips 32] [--data DIR]
        [--torchcodec-site DIR] [--settings 1t,2clip,2ff] [--out FILE]

Workload: 16-frame clips at stride 4 (frames s, s+4, ..., s+60) at seeded random starts, over 16
H.264 640x360 MP4 files with B-frames (made here with PyAV, the same bytes every time, cached
under the temp folder), decoded to uint8 RGB ``[16, 360, 640, 3]``. Each contender opens the file
for each clip, as a loader of random clips from many files does; per-file indexing that a loader
would do once (avpipe's scan cache, the PyAV contender's pts list) is warm before timing.

Contenders:

* ``avpipe``: ``VideoDecoder(path, device="cpu", threads=T).get_frames(indices)``.
* ``avpipe_default`` (with ``--default``): the same with ``threads`` left unset.
* ``pyav``: seek to the clip's first frame (lands on the keyframe at or before it), decode forward
  to the clip's last frame, ``to_ndarray(format="rgb24")`` of the 16 wanted frames.
* ``torchcodec``: ``VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=T,
  dimension_order="NHWC").get_frames_at(indices)`` (its exact mode scans the file at each open).

Settings: ``1t`` one clip at a time, one decoder thread; ``2clip`` two clips at a time (two
Python threads), one decoder thread each; ``2ff`` one clip at a time, two FFmpeg threads
(frame + slice threading). ``--rounds`` interleaved rounds (each round runs every setting and
every contender, the contenders' order rotating); the result is each contender's median
clips/s and the ratio of the medians. A warm-up pass per setting and contender decodes every
clip once and checks that every contender in every setting returns the same bytes for every
clip.

torchcodec is loaded from ``--torchcodec-site`` (a ``pip install --target`` folder) against PyAV's
own FFmpeg libraries: the script links them under their plain names in that folder and
restarts itself with ``LD_LIBRARY_PATH`` pointing there. When it does not load, the reason goes
into the results and the other contenders run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

N_FILES, W, H, FPS, N_FRAMES = 16, 640, 360, 30, 240
CLIP_LEN, STRIDE = 16, 4
X264 = "bframes=3:keyint=60:min-keyint=30:threads=1"  # fixed threads: the same bytes anywhere
SETTINGS = {"1t": (1, 1), "2clip": (2, 1), "2ff": (1, 2)}  # name: (clip threads, decoder threads)
_ENV_MARK = "AVPIPE_BENCH_TC_LIBS"


# -- data ------------------------------------------------------------------------------------
def _frame(rng_seed: int, t: int):
    """Frame ``t`` of file ``rng_seed``: drifting gradients, moving boxes and a little noise."""
    import numpy as np

    rng = np.random.default_rng([rng_seed, 7])
    boxes = rng.integers(0, 255, size=(6, 5))
    y, x = np.mgrid[0:H, 0:W].astype(np.int32)
    img = np.stack([(x + 3 * t) % 256, (y * 2 + t) % 256, (x + y + 5 * t) % 256], -1)
    for k, (bx, by, c, vx, vy) in enumerate(boxes):
        cx = int(bx * W / 255 + (vx - 128) / 16 * t) % W
        cy = int(by * H / 255 + (vy - 128) / 32 * t) % H
        img[cy:cy + 48, cx:cx + 64] = (c, 255 - c, (c * (k + 1)) % 256)
    noise = np.random.default_rng([rng_seed, t]).integers(0, 12, size=(H, W, 1))
    return (img + noise).clip(0, 255).astype(np.uint8)


def make_data(folder: str) -> list[str]:
    """The 16 files (made once; a finished file is never rewritten)."""
    import av

    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in range(N_FILES):
        p = os.path.join(folder, f"h264_{i:02d}.mp4")
        paths.append(p)
        if os.path.exists(p):
            continue
        tmp = p + ".tmp"
        with av.open(tmp, "w", format="mp4") as out:
            st = out.add_stream("libx264", rate=FPS)
            st.width, st.height, st.pix_fmt = W, H, "yuv420p"
            st.options = {"preset": "veryfast", "crf": "23", "x264-params": X264}
            for t in range(N_FRAMES):
                fr = av.VideoFrame.from_ndarray(_frame(i, t), format="rgb24")
                for pkt in st.encode(fr):
                    out.mux(pkt)
            for pkt in st.encode(None):
                out.mux(pkt)
        os.replace(tmp, p)
    return paths


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


CONTENDERS = {"avpipe": avpipe_clip, "avpipe_default": avpipe_default_clip,
              "pyav": pyav_clip, "torchcodec": torchcodec_clip}


# -- torchcodec against PyAV's FFmpeg ---------------------------------------------------------
def _link_ffmpeg(site: str) -> str:
    """A folder of links under their plain sonames (``libavutil.so.60``) to PyAV's bundled
    FFmpeg libraries, which is what torchcodec's core library asks the loader for."""
    import av

    libs = os.path.join(os.path.dirname(os.path.dirname(av.__file__)), "av.libs")
    dst = os.path.join(site, "ffmpeg-libs")
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(libs):
        m = re.match(r"(lib(?:av|sw)[a-z]+)-[0-9a-f]{8}\.so\.(\d+)", name)
        if m:
            link = os.path.join(dst, f"{m.group(1)}.so.{m.group(2)}")
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.join(libs, name), link)
    return dst + os.pathsep + libs


def _maybe_reexec(site: str | None):
    if not site or os.environ.get(_ENV_MARK):
        return
    env = dict(os.environ)
    env[_ENV_MARK] = "1"
    env["LD_LIBRARY_PATH"] = _link_ffmpeg(site) + (
        os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, site, env.get("PYTHONPATH")) if p)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _load_torchcodec(site):
    if not site:
        return None, "not asked for (--torchcodec-site)"
    try:
        import torchcodec
        from torchcodec.decoders import VideoDecoder  # noqa: F401

        return torchcodec.__version__, None
    except Exception as e:  # noqa: BLE001 — reported, the other contenders still run
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


# -- running ---------------------------------------------------------------------------------
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


def _versions(tc_version):
    import av
    import numpy as np

    ff = getattr(av, "ffmpeg_version_info", None) or ".".join(
        map(str, av.library_versions.get("libavcodec", ())))
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       None)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--",
                                     "avpipe"], capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"git_commit": commit, "avpipe_tree_dirty": dirty,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "av": av.__version__, "ffmpeg": ff, "torchcodec": tc_version,
            "numpy": np.__version__, "python": sys.version.split()[0], "cpu_model": cpu,
            "cpu_count": os.cpu_count()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "avpipe_cpu_clips"))
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="1t,2clip,2ff")
    ap.add_argument("--default", action="store_true",
                    help="also time avpipe with threads left unset")
    ap.add_argument("--torchcodec-site", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_clips.json"))
    a = ap.parse_args()
    _maybe_reexec(a.torchcodec_site)
    import _timing

    tc_version, tc_reason = _load_torchcodec(a.torchcodec_site)
    names = ["avpipe", "pyav"] + (["avpipe_default"] if a.default else [])
    if tc_version:
        names.append("torchcodec")
    settings = [s for s in a.settings.split(",") if s]
    paths = make_data(a.data)
    clips = make_clips(paths, a.clips)
    import avpipe

    for p in paths:  # per-file indexing before any timing
        avpipe.VideoDecoder(p, device="cpu").close()
        _pts(p)

    identical, mismatch, ref = True, [], None
    for s in settings:  # warm-up and frame check: every setting and contender, the same bytes
        ct, th = SETTINGS[s]
        for n in names:
            _, dig = run_clips(CONTENDERS[n], clips, ct, th, digest=True)
            if ref is None:
                ref = (f"{s}/{n}", dig)
            elif dig != ref[1]:
                identical = False
                bad = [k for k, (x, y) in enumerate(zip(dig, ref[1])) if x != y]
                mismatch.append({"setting": s, "contender": n, "against": ref[0],
                                 "clips": bad[:8], "count": len(bad)})
    runs = {s: {n: [] for n in names} for s in settings}
    for r in range(a.rounds):
        for s in settings:
            ct, th = SETTINGS[s]
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                sec, _ = run_clips(CONTENDERS[n], clips, ct, th)
                runs[s][n].append({"round": r, "value": len(clips) / sec})
    results = {}
    for s in settings:
        med = {n: _timing.median_run(runs[s][n]) for n in names}
        res = {"clips_per_s": {n: round(med[n]["value"], 2) for n in names},
               "rounds": {n: [round(v, 2) for v in med[n]["runs"]] for n in names}}
        for other in names:
            if other != "avpipe":
                res[f"avpipe_over_{other}"] = round(med["avpipe"]["value"] / med[other]["value"], 3)
        results[s] = res
        print(s, json.dumps(res))
    out = {"workload": {"files": len(paths), "size": f"{W}x{H}", "frames_per_file": N_FRAMES,
                        "x264": X264, "clip_len": CLIP_LEN, "stride": STRIDE, "clips": len(clips),
                        "rounds": a.rounds, "open_per_clip": True},
           "settings": {s: {"clip_threads": SETTINGS[s][0], "decoder_threads": SETTINGS[s][1]}
                        for s in settings},
           "results": results, "frames_identical": identical, "mismatches": mismatch,
           "torchcodec_unavailable": tc_reason, "versions": _versions(tc_version)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("frames identical:", identical, mismatch[:3])
    print("wrote", a.out)


if __name__ == "__main__":
    main()
