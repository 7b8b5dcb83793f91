"""Feature extraction to disk: ``avpipe extract`` against a straightforward DALI script.

    python3 benchmarks/bench_extract.py --data /tmp/bench --out DIR [--repeat 32] [--only a,b]
    python3 benchmarks/bench_extract.py --cpu --out DIR      # small, avpipe only, on the CPU

Workloads (the data of bench_audio.py / bench_video.py: /tmp/bench/audio_flac_16k/utt_*.flac,
512 files of 2-16 s, and /tmp/bench/videos_640x360_*f/h264_*.mp4; generated when missing):

* ``avpipe_nemo``: ``run_extract(list, preset="nemo", format="tar")`` over a file list that
  names the 512 FLAC files ``--repeat`` times (a job long enough that start-up does not
  dominate), on every GPU (``--cpu``: the CPU; ``--devices cuda:0,cuda:0``: two workers on
  one GPU) -> audio-seconds per second, *written*: the clock runs from the call to the last
  shard renamed into place and the index written.
* ``dali_nemo``: the same job as one would write it with DALI: fn.readers.file ->
  fn.decoders.audio -> preemphasis_filter -> spectrogram(512/400/160) -> mel_filter_bank(80)
  -> to_decibels (ln) -> normalize (per feature) on the GPU, each batch copied to the host and
  every utterance's valid frames saved as ``KEY.npy`` into tar shards of 512 (a writer thread).
  ``--dtype float16``: both store float16 (avpipe's ``dtype``, DALI's fn.cast).
* ``avpipe_frames``: ``run_extract(videos, preset="frames", fps=1)`` -> files/s (and frames/s).
* ``dali_frames``: fn.readers.file (each file's bytes, the last batch padded) ->
  fn.experimental.decoders.video (mixed) -> every ``round(fps_file)``-th frame -> resize shorter
  224 -> crop 224 -> npy in tar shards of 64.

Besides the total rate, each contender reports ``startup_s``: the time from the start to its
first shard written (process start, imports, CUDA, kernel compilation, the first shard's work),
and ``steady``: the rate over the rest (the work after the first shard over the time after it),
what a long job approaches. Outputs are deleted after they are measured (``--keep`` keeps them).

Each contender runs in its own child process (a crash or a hang cannot take the others down)
and prints ``RESULT {json}``; the parent writes DIR/bench_extract.json and a table.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

SR = 16000
BATCH = 64
SHARD = 512
VIDEO_SHARD = 64
CONTENDERS = ["avpipe_nemo", "dali_nemo", "avpipe_frames", "dali_frames"]


def log(*a):
    print(*a, flush=True)


def audio_data(args):
    """The anchor data's FLAC files when present, else bench_audio.py's fallback files (the
    same layout, made once): ``(files, durations, origin)``."""
    from bench_audio import durations, ensure_data

    files, origin = ensure_data(args.data, args.files)
    return files, durations(files), origin


def video_data(args):
    from bench_video import find_files

    files = find_files(args.data)
    return files[: args.videos] if args.videos else files


class FirstShard:
    """Watches ``DIR/parts`` (avpipe) for the first shard's part: the shard and its part are
    renamed into place, the first output of the run is complete. ``at``: seconds from
    ``t0``; ``name``: the part's name (``shard-AAAAAA-BBBBBB.jsonl``)."""

    def __init__(self, out, t0):
        self.parts, self.t0 = os.path.join(out, "parts"), t0
        self.at = self.name = None
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop and self.at is None:
            try:
                names = [n for n in os.listdir(self.parts) if n.endswith(".jsonl")]
            except OSError:
                names = []
            if names:
                self.at, self.name = time.perf_counter() - self.t0, min(names)
                return
            time.sleep(0.002)

    def stop(self):
        self._stop = True
        self.t.join()

    def items(self):
        """The input indices of the first shard written."""
        a, b = self.name[: -len(".jsonl")].split("-")[1:]
        return range(int(a), int(b) + 1)


def _phases(total_s, first_s, work, first_work):
    """``startup_s`` (to the first shard written) and ``steady`` (the rest of the work over
    the rest of the time)."""
    if first_s is None:
        return {"startup_s": None, "steady": None}
    rest = total_s - first_s
    return {"startup_s": round(first_s, 3),
            "steady": round((work - first_work) / rest, 1)
            if rest > 0 and work > first_work else None}


def _list_file(files, repeat, path):
    with open(path, "w") as f:
        for _ in range(repeat):
            for p in files:
                f.write(p + "\n")
    return path


# --- avpipe ---------------------------------------------------------------------------------


def bench_avpipe_nemo(args):
    from avpipe.recipes.extract import run_extract

    files, durs, _ = audio_data(args)
    out = os.path.join(args.work, "avpipe_nemo")
    shutil.rmtree(out, ignore_errors=True)
    lst = _list_file(files, args.repeat, os.path.join(args.work, "nemo_files.txt"))
    devices = args.devices or ("cpu" if args.cpu else None)
    t0 = time.perf_counter()
    first = FirstShard(out, t0)
    s = run_extract(lst, preset="nemo", out_dir=out, devices=devices, shard_size=args.shard_size,
                    progress=False, workers=args.workers, batch_size=args.batch_size,
                    dtype=args.dtype)
    secs = time.perf_counter() - t0
    first.stop()
    audio_s = sum(durs) * args.repeat
    assert s.complete and s.errors == 0, s.format()
    job_durs = durs * args.repeat
    first_audio = sum(job_durs[i] for i in first.items()) if first.name else 0.0
    return audio_s / secs, "audio_s/s", {
        "files": len(files) * args.repeat, "audio_seconds": round(audio_s, 1),
        "seconds": round(secs, 3), **_phases(secs, first.at, audio_s, first_audio),
        "devices": s.devices, "shards": s.shards_total,
        "batch_size": args.batch_size or 64, "dtype": args.dtype,
        "bytes": _done(out, args)}


def bench_avpipe_frames(args):
    from avpipe.recipes.extract import run_extract

    files = video_data(args)
    out = os.path.join(args.work, "avpipe_frames")
    shutil.rmtree(out, ignore_errors=True)
    lst = _list_file(files, args.repeat_video, os.path.join(args.work, "video_files.txt"))
    t0 = time.perf_counter()
    first = FirstShard(out, t0)
    s = run_extract(lst, preset="frames", fps=1.0, out_dir=out,
                    devices=args.devices or ("cpu" if args.cpu else None),
                    shard_size=args.video_shard_size, progress=False, workers=args.workers)
    secs = time.perf_counter() - t0
    first.stop()
    assert s.complete and s.errors == 0, s.format()
    n = len(files) * args.repeat_video
    return n / secs, "files/s", {"files": n, "frames": int(s.frames), "seconds": round(secs, 3),
                                 **_phases(secs, first.at, n,
                                           len(first.items()) if first.name else 0),
                                 "frames_per_s": round(s.frames / secs, 1),
                                 "devices": s.devices, "bytes": _done(out, args)}


def _size(d):
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(d) for f in fs)


def _done(out, args):
    """The bytes written to ``out``; the folder is deleted unless --keep (a long default job
    writes gigabytes per contender)."""
    n = _size(out)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return n


# --- DALI -----------------------------------------------------------------------------------


class TarShards:
    """A writer thread: (key, array) -> tar shards of ``size`` members, npy each, fsync +
    rename. ``first_at``: when the first shard was renamed into place (perf_counter)."""

    def __init__(self, out, size=SHARD):
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.size = size
        self.first_at = None
        self.first_n = 0
        self.q = queue.Queue(maxsize=8)
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def put(self, items):
        self.q.put(items)

    def _run(self):
        buf, n = [], 0
        while True:
            items = self.q.get()
            if items is not None:
                buf.extend(items)
            while len(buf) >= self.size or (items is None and buf):
                chunk, buf = buf[: self.size], buf[self.size :]
                self._write(n, chunk)
                n += len(chunk)
            if items is None:
                return

    def _write(self, start, chunk):
        path = os.path.join(self.out, f"shard-{start:06d}-{start + len(chunk) - 1:06d}.tar")
        with open(path + ".partial", "wb") as f:
            with tarfile.open(fileobj=f, mode="w") as tf:
                for key, arr in chunk:
                    b = io.BytesIO()
                    np.save(b, arr)
                    ti = tarfile.TarInfo(f"{key}.npy")
                    ti.size = b.tell()
                    b.seek(0)
                    tf.addfile(ti, b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".partial", path)
        if self.first_at is None:
            self.first_at, self.first_n = time.perf_counter(), len(chunk)

    def close(self):
        self.q.put(None)
        self.t.join()


def bench_dali_nemo(args):
    from nvidia.dali import fn, pipeline_def, types

    files, durs, _ = audio_data(args)
    job = files * args.repeat
    out = os.path.join(args.work, "dali_nemo")
    shutil.rmtree(out, ignore_errors=True)
    lens = {p: int(round(d * SR)) for p, d in zip(files, durs)}

    @pipeline_def(batch_size=BATCH, num_threads=args.threads, device_id=0, seed=1)
    def pipe_fn():
        enc, _ = fn.readers.file(files=job, random_shuffle=False, name="Reader")
        audio, _ = fn.decoders.audio(enc, downmix=True, sample_rate=SR, dtype=types.FLOAT)
        x = fn.preemphasis_filter(audio.gpu(), preemph_coeff=0.97)
        x = fn.spectrogram(x, nfft=512, window_length=400, window_step=160, power=2)
        x = fn.mel_filter_bank(x, sample_rate=SR, nfilter=80)
        x = fn.to_decibels(x, multiplier=math.log(10), reference=1.0,
                           cutoff_db=math.log(2.0 ** -24))
        x = fn.normalize(x, axes=[1])
        return fn.cast(x, dtype=types.FLOAT16) if args.dtype == "float16" else x

    t0 = time.perf_counter()
    pipe = pipe_fn()
    pipe.build()
    w = TarShards(out, args.shard_size)
    k = 0
    while k < len(job):
        (feats,) = pipe.run()
        host = feats.as_cpu()
        items = []
        for i in range(min(BATCH, len(job) - k)):
            a = np.array(host.at(i))
            items.append((f"{k:09d}", a[:, : lens[job[k]] // 160]))
            k += 1
        w.put(items)
    w.close()
    secs = time.perf_counter() - t0
    audio_s = sum(durs) * args.repeat
    import nvidia.dali as dali

    first_audio = sum(lens[p] for p in job[: w.first_n]) / SR
    first_s = None if w.first_at is None else w.first_at - t0
    return audio_s / secs, "audio_s/s", {"files": len(job), "audio_seconds": round(audio_s, 1),
                                         "seconds": round(secs, 3),
                                         **_phases(secs, first_s, audio_s, first_audio),
                                         "dtype": args.dtype, "dali": dali.__version__,
                                         "bytes": _done(out, args)}


def bench_dali_frames(args):
    from nvidia.dali import fn, pipeline_def

    files = video_data(args) * args.repeat_video
    out = os.path.join(args.work, "dali_frames")
    shutil.rmtree(out, ignore_errors=True)
    import av
    import cupy

    from avpipe.ops import image as im  # the same resize / crop on the GPU

    def fps_of(p):
        with av.open(p) as c:
            return float(c.streams.video[0].average_rate or 30)

    steps = {p: max(1, int(round(fps_of(p)))) for p in set(files)}
    batch = 4

    # the file reader hands the decoder a batch every iteration (an external source fed once
    # per run() is not enough: run() also schedules the prefetch iterations, which then find
    # no data); the last batch is padded with its last file, the padding is dropped below
    @pipeline_def(batch_size=batch, num_threads=args.threads, device_id=0, seed=1)
    def pipe_fn():
        enc, _ = fn.readers.file(files=files, random_shuffle=False, pad_last_batch=True,
                                 name="Reader")
        return fn.experimental.decoders.video(enc, device="mixed")

    t0 = time.perf_counter()
    pipe = pipe_fn()
    pipe.build()
    w = TarShards(out, args.video_shard_size)
    n_frames = 0
    for k in range(0, len(files), batch):
        chunk = files[k : k + batch]
        (frames,) = pipe.run()
        items = []
        for i, p in enumerate(chunk):
            v = cupy.asarray(frames[i])[:: steps[p]]  # 1 frame a second
            v = im.center_crop(im.resize(v, short_side=224), 224)
            items.append((f"{k + i:09d}", cupy.asnumpy(v)))
            n_frames += int(v.shape[0])
        w.put(items)
    w.close()
    secs = time.perf_counter() - t0
    first_s = None if w.first_at is None else w.first_at - t0
    return len(files) / secs, "files/s", {"files": len(files), "frames": n_frames,
                                          "seconds": round(secs, 3),
                                          **_phases(secs, first_s, len(files), w.first_n),
                                          "bytes": _done(out, args)}


# --- driver ---------------------------------------------------------------------------------


def child(name, args):
    try:
        value, unit, extra = globals()[f"bench_{name}"](args)
        res = {"name": name, "value": round(value, 1), "unit": unit, "extra": extra}
    except (ImportError, ModuleNotFoundError) as e:
        res = {"name": name, "value": None, "error": f"n/a ({type(e).__name__}: {e})"}
    except Exception as e:  # noqa: BLE001
        res = {"name": name, "value": None, "error": f"{type(e).__name__}: {e}",
               "trace": traceback.format_exc()[-2000:]}
    print("RESULT " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/bench")
    ap.add_argument("--out", default=".")
    ap.add_argument("--work", default=None, help="where outputs are written (default OUT/work)")
    ap.add_argument("--only", default="")
    ap.add_argument("--cpu", action="store_true", help="small, avpipe only, on the CPU")
    ap.add_argument("--files", type=int, default=None, help="FLAC files (default 512; --cpu 24)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="passes over them (default 32: about 150,000 audio-s, 4.8 GB of "
                         "float32 log-mel; --cpu 4)")
    ap.add_argument("--videos", type=int, default=None, help="video files (default all; --cpu 2)")
    ap.add_argument("--repeat-video", type=int, default=None)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=None, help="avpipe's feature batch")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--devices", default=None,
                    help="avpipe's devices (default every GPU; --cpu: cpu); e.g. cuda:0,cuda:0")
    ap.add_argument("--keep", action="store_true", help="keep the outputs")
    ap.add_argument("--profile", action="store_true",
                    help="avpipe's per-stage times (AVPIPE_EXTRACT_PROFILE) into the results")
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                    help="the log-mel features' type, avpipe and DALI alike")
    ap.add_argument("--shard-size", type=int, default=None,
                    help=f"inputs per audio shard (default {SHARD}; --cpu 24)")
    ap.add_argument("--video-shard-size", type=int, default=None,
                    help=f"inputs per video shard (default {VIDEO_SHARD}; --cpu 1)")
    ap.add_argument("--timeout", type=float, default=540.0)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.files is None:
        args.files = 24 if args.cpu else 512
    if args.repeat is None:
        args.repeat = 4 if args.cpu else 32
    if args.shard_size is None:
        args.shard_size = 24 if args.cpu else SHARD
    if args.video_shard_size is None:
        args.video_shard_size = 1 if args.cpu else VIDEO_SHARD
    if args.videos is None:
        args.videos = 2 if args.cpu else 0
    if args.repeat_video is None:
        args.repeat_video = 1 if args.cpu else 4
    args.work = args.work or os.path.join(args.out, "work")
    if args.child:
        os.makedirs(args.work, exist_ok=True)
        return child(args.child, args)
    os.makedirs(args.out, exist_ok=True)
    default = ["avpipe_nemo", "avpipe_frames"] if args.cpu else CONTENDERS
    names = [n for n in (args.only.split(",") if args.only else default) if n]
    results = {"workload": {"cpu": args.cpu, "files": args.files, "repeat": args.repeat,
                            "shard_size": args.shard_size, "devices": args.devices,
                            "dtype": args.dtype,
                            "videos": args.videos, "repeat_video": args.repeat_video,
                            "cpus": os.cpu_count()}, "results": {}}
    out_path = os.path.join(args.out, "bench_extract.json")
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name,
               *[a for a in sys.argv[1:] if not a.startswith("--only")]]
        if "--only" in sys.argv:  # drop the value that followed --only
            i = sys.argv.index("--only")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name,
                   *sys.argv[1:i], *sys.argv[i + 2 :]]
        log(f"--- {name}")
        try:
            env = {**os.environ, **({"AVPIPE_EXTRACT_PROFILE": "1"} if args.profile else {})}
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {
                "name": name, "value": None, "error": f"exit {p.returncode}: {p.stderr[-1500:]}"}
            prof = [ln for ln in p.stderr.splitlines() if ln.startswith("avpipe extract profile")]
            if prof:
                res["profile"] = prof
        except subprocess.TimeoutExpired:
            res = {"name": name, "value": None, "error": f"timeout after {args.timeout} s"}
        log(json.dumps(res)[:800])
        results["results"][name] = res
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    log(f"\n{'contender':<16} {'total':>12} {'startup s':>10} {'steady':>12}  unit")
    for name, r in results["results"].items():
        v = r.get("value")
        ex = r.get("extra", {})
        shown = "-" if v is None else f"{v:,.1f}"
        st = "-" if ex.get("startup_s") is None else f"{ex['startup_s']:.2f}"
        sd = "-" if ex.get("steady") is None else f"{ex['steady']:,.1f}"
        log(f"{name:<16} {shown:>12} {st:>10} {sd:>12}  {r.get('unit', r.get('error', ''))[:60]}")
    log(f"wrote {out_path}")


if __name__ == "__main__":
    main()
