"""Feature extraction to disk: ``avpipe extract`` against a straightforward DALI script.

Workloads (:func:`benchmarks.data.anchor_data`: 512 FLAC files of 2-16 s and the H.264
640x360 files):

* ``avpipe_nemo``: ``run_extract(list, preset="nemo", format="tar")`` over a file list that
  names the 512 FLAC files ``repeat`` times (a job long enough that start-up does not
  dominate), on every GPU (``devices``: e.g. ``cuda:0,cuda:0``, two workers on one GPU) -> audio-seconds per second, *written*: the clock runs from the call to the last
  shard renamed into place and the index written.
* ``dali_nemo``: the same job as one would write it with DALI: fn.readers.file ->
  fn.decoders.audio -> preemphasis_filter -> spectrogram(512/400/160) -> mel_filter_bank(80)
  -> to_decibels (ln) -> normalize (per feature) on the GPU, each batch copied to the host and
  every utterance's valid frames saved as ``KEY.npy`` into tar shards of 512, written by as
  many writer threads as avpipe's (``AVPIPE_EXTRACT_WRITERS``, 4) with the same early
  writeback (``sync_file_range`` every ``AVPIPE_EXTRACT_WRITEBACK_MB``), fsync'd and renamed.
  ``dtype`` float16: both store float16 (avpipe's ``dtype``, DALI's fn.cast).
* ``avpipe_frames``: ``run_extract(videos, preset="frames", fps=1)`` -> files/s (and frames/s).
* ``dali_frames``: fn.readers.file (each file's bytes, the last batch padded) ->
  fn.experimental.decoders.video (mixed) -> every ``round(fps_file)``-th frame -> resize shorter
  224 -> crop 224 -> npy in tar shards of 64.

Besides the total rate, each contender reports ``startup_s``: the time from the start to its
first shard written (process start, imports, CUDA, kernel compilation, the first shard's work),
and ``steady``: the rate over the rest (the work after the first shard over the time after it),
what a long job approaches. Outputs are deleted after they are measured (``keep`` keeps them).

The job is disk-bound: the disk's own ceiling (:func:`disk_ceiling`: fsync'd tar-sized files
written by the same number of writer threads, MB/s) is measured before and after the rounds
and kept beside the results, with each contender's MB/s written.
"""

from __future__ import annotations

import io
import math
import os
import queue
import shutil
import tarfile
import threading
import time

import numpy as np

SR = 16000
BATCH = 64
SHARD = 512
VIDEO_SHARD = 64




def audio_data(args):
    """The shared data's FLAC files: ``(files, durations, origin)``."""
    from benchmarks.workloads.audio import durations, ensure_data

    files, origin = ensure_data(args.data, args.files, getattr(args, "quick", False))
    return files, durations(files), origin


def video_data(args):
    from benchmarks import data

    files = data.anchor_data(args.data, getattr(args, "quick", False))["h264"]
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
    """(key, array) -> tar shards of ``size`` members, npy each, written as avpipe writes its
    shards: ``writers`` threads (avpipe's ``AVPIPE_EXTRACT_WRITERS``), each file's writeback
    started every ``AVPIPE_EXTRACT_WRITEBACK_MB`` (avpipe's ``_Writeback``), fsync + rename.
    ``first_at``: when the first shard was renamed into place (perf_counter)."""

    def __init__(self, out, size=SHARD, writers=None):
        from avpipe import settings

        os.makedirs(out, exist_ok=True)
        self.out = out
        self.size = size
        self.writers = writers or settings.extract_writers()
        self.every = settings.extract_writeback_mb() << 20
        self.first_at = None
        self.first_n = 0
        self.lock = threading.Lock()
        self.q = queue.Queue(maxsize=8)
        self.wq = queue.Queue(maxsize=2)  # whole shards, as avpipe's write queue
        self.t = threading.Thread(target=self._run, daemon=True)
        self.ws = [threading.Thread(target=self._writer, daemon=True)
                   for _ in range(self.writers)]
        for t in [self.t, *self.ws]:
            t.start()

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
                self.wq.put((n, chunk))
                n += len(chunk)
            if items is None:
                for _ in self.ws:
                    self.wq.put(None)
                return

    def _writer(self):
        while True:
            job = self.wq.get()
            if job is None:
                return
            self._write(*job)

    def _write(self, start, chunk):
        path = os.path.join(self.out, f"shard-{start:06d}-{start + len(chunk) - 1:06d}.tar")
        with open(path + ".partial", "wb") as f:
            out = _EarlyWriteback(f, self.every) if self.every else f
            with tarfile.open(fileobj=out, mode="w") as tf:
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
        with self.lock:
            if self.first_at is None:
                self.first_at, self.first_n = time.perf_counter(), len(chunk)

    def close(self):
        self.q.put(None)
        self.t.join()
        for t in self.ws:
            t.join()


class _EarlyWriteback:
    """``f`` whose bytes are handed to the disk every ``every`` bytes written
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, the call avpipe's shard writer makes), for
    ``tarfile``: ``write`` and ``tell``."""

    def __init__(self, f, every):
        from avpipe.recipes.extract import _writers

        self.f, self.every, self.pos, self.done = f, int(every), f.tell(), f.tell()
        self.sync = _writers._SYNC_FILE_RANGE
        self.flag = _writers._SYNC_FILE_RANGE_WRITE

    def write(self, b):
        n = self.f.write(b)
        self.pos += n
        if self.sync is not None and self.pos - self.done >= self.every:
            self.f.flush()
            self.sync(self.f.fileno(), self.done, self.pos - self.done, self.flag)
            self.done = self.pos
        return n

    def tell(self):
        return self.pos


def disk_ceiling(folder, total_mb=1024, file_mb=32, writers=None):
    """The disk's fsync'd write rate in MB/s: ``total_mb`` of incompressible bytes in files of
    ``file_mb`` (about a shard) written by ``writers`` threads (avpipe's writer count), each file
    fsync'd and renamed, as the shards are."""
    from avpipe import settings

    writers = writers or settings.extract_writers()
    d = os.path.join(folder, "disk_ceiling")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    n = max(1, total_mb // file_mb)

    def one(i):
        p = os.path.join(d, f"f{i:05d}")
        with open(p + ".partial", "wb") as f:
            for _ in range(file_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        os.replace(p + ".partial", p)

    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(one, range(n)))
    secs = time.perf_counter() - t0
    shutil.rmtree(d, ignore_errors=True)
    return {"MB_per_s": round(n * file_mb / secs, 1), "MB": n * file_mb, "file_MB": file_mb,
            "writers": writers, "seconds": round(secs, 3)}


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








# --- harness ----------------------------------------------------------------------------------

NAME = "extract"
SUITE = "gpu"
UNIT = "audio-s/s (nemo) or files/s (frames)"
TITLE = ("avpipe extract --preset nemo over the 512 FLAC files listed 32 times to tar shards "
         "(audio-s/s written); the frames preset at 1 fps over the H.264 files (files/s)")
CONTENDERS = {
    "avpipe_nemo": "run_extract(preset=nemo, format=tar), every GPU, 4 writer threads, early "
                   "writeback",
    "dali_nemo": "DALI decode + log-mel chain, npy into tar shards by the same 4 writer threads "
                 "with the same early writeback",
    "avpipe_frames": "run_extract(preset=frames, fps=1) (files/s)",
    "dali_frames": "DALI experimental.decoders.video, every fps-th frame, resize + crop, tar "
                   "shards by 4 writer threads (files/s)",
}
RATIOS = [("avpipe_nemo", "dali_nemo"), ("avpipe_frames", "dali_frames")]
NOTES = ["Extraction is bound by the disk: the checks give the disk's own fsync'd write "
         "ceiling (MB/s, the same writer threads) and each contender's extra its MB/s written."]
PARAMS = {"files": 512, "repeat": 32, "videos": 0, "repeat_video": 4, "threads": 16,
          "batch_size": None, "workers": None, "devices": None, "keep": False,
          "dtype": "float32", "shard_size": SHARD, "video_shard_size": VIDEO_SHARD,
          "ceiling_mb": 2048, "profile": False}
QUICK = {"files": 32, "repeat": 2, "videos": 2, "repeat_video": 1, "shard_size": 16,
         "video_shard_size": 2, "ceiling_mb": 128}
REQUIRES = ("gpu", "cupy")


def _args(ctx):
    from types import SimpleNamespace

    work = os.path.join(ctx.data_dir, "extract_work")
    os.makedirs(work, exist_ok=True)
    return SimpleNamespace(data=ctx.data_dir, work=work, quick=ctx.quick, cpu=False,
                           **ctx.params)


def prepare(ctx):
    from benchmarks import data

    data.anchor_data(ctx.data_dir, ctx.quick)
    return {}


def measure(ctx, name):
    if ctx.params.get("profile"):  # avpipe's per-stage times, printed by its workers
        os.environ["AVPIPE_EXTRACT_PROFILE"] = "1"
    value, unit, extra = globals()[f"bench_{name}"](_args(ctx))
    if extra.get("bytes") and extra.get("seconds"):
        extra["MB_per_s_written"] = round(extra["bytes"] / 1e6 / extra["seconds"], 1)
    return value, dict(extra, unit=unit)


def check(ctx):
    a = _args(ctx)
    return {"disk_ceiling_before": disk_ceiling(a.work, a.ceiling_mb)}


def finish(ctx):
    a = _args(ctx)
    return {"disk_ceiling_after": disk_ceiling(a.work, a.ceiling_mb)}
