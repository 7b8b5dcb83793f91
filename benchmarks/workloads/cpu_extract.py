#!/usr/bin/env python3
"""Feature extraction to tar shards on the CPU: ``avpipe extract --preset nemo --devices cpu``
against the same job written with soundfile + torch, in interleaved rounds.

Workload: the RNN-T feed workload's data (``files``: 256 speech-like FLAC files of 2-16 s at
16 kHz, generated once into the data folder) and its NeMo manifest, the input of every contender.
The rate is audio-seconds per second from the call to the last shard (and index) written;
each contender runs in a fresh child process, its imports not timed (``process_wall_s``: the
whole child, imports and interpreter start included).

Contenders:

* ``avpipe``: ``run_extract(manifest, preset="nemo", out_dir=..., devices="cpu",
  shard_size=S, progress=False)`` (what ``avpipe extract MANIFEST --preset nemo --out DIR
  --devices cpu --shard-size S`` runs): its default workers, batch 64, 4 writer threads
  (``AVPIPE_EXTRACT_WRITERS``).
* ``torch_p2`` / ``torch_t2``: the straightforward script: each FLAC read with
  ``soundfile.read(dtype="float32")``, NeMo's log-mel of the ``nemo`` preset in torch, one
  file at a time (no padding): preemphasis 0.97, ``torch.stft`` (n_fft 512, hop 160, symmetric
  Hann of 400 centred, zero padding), power 2, librosa's 80 Slaney mel filters 0-8 kHz (what
  NeMo builds), ln(x + 2^-24), the first n // 160 frames kept and normalized per feature
  ((x - mean) / (std + 1e-5), n-1 std) -> ``[80, n // 160]`` float32; in 2 worker processes
  (``multiprocessing.Pool(2)``, fork, ``imap`` in input order, torch at 1 thread each) or 2
  threads (a ``ThreadPoolExecutor``, torch at 1 thread); the main process groups the results
  into shards of S and hands each to 4 writer threads (a queue of 2 shards, as avpipe's):
  ``tarfile`` members ``KEY.npy`` (``np.save``) + ``KEY.json`` (the manifest fields, shape,
  dtype), KEY the 9-digit input index, written to a ``.partial`` file, fsync'ed and renamed;
  an ``index.jsonl`` at the end.

What differs in the writing: avpipe also writes a per-shard index part, ``extract.json`` and
``errors.jsonl``, builds tar headers from a template and writes arrays without a copy; the
script uses ``tarfile`` and ``np.save`` into a buffer. Features: the same preset, checked
after the rounds (max |avpipe - torch| over every stored value of the last round, shapes and
keys equal).

``avpipe_profiled`` (only when named) is avpipe's run with its stage timer on, beside the
script's stages on one thread.
"""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from types import SimpleNamespace

import numpy as np

from benchmarks import data as bdata
from benchmarks.data import read_manifest
from benchmarks.harness import ROOT, cpu_seconds

SR = 16000
WRITERS = 4
WRITE_QUEUE = 2


_FB = _WIN = None


def _setup():
    """torch at one thread; the mel filters and window (once per process)."""
    global _FB, _WIN
    import librosa
    import torch

    torch.set_num_threads(1)
    if _FB is None:
        _FB = torch.from_numpy(librosa.filters.mel(sr=SR, n_fft=512, n_mels=80, fmin=0.0,
                                                   fmax=8000.0, htk=False, norm="slaney")
                               ).float()
        _WIN = torch.hann_window(400, periodic=False)


def nemo_log_mel(x: np.ndarray) -> np.ndarray:
    """NeMo 2.x ``FilterbankFeatures`` (eval, no dither) of one signal: ``[80, n // 160]``."""
    import torch

    t = torch.from_numpy(x)
    n = t.shape[0]
    t = torch.cat([t[:1], t[1:] - 0.97 * t[:-1]])
    spec = torch.stft(t, n_fft=512, hop_length=160, win_length=400, window=_WIN, center=True,
                      pad_mode="constant", return_complex=True)
    power = spec.real.square() + spec.imag.square()
    lm = torch.log(_FB @ power + 2.0 ** -24)[:, : n // 160]
    mean = lm.mean(1, keepdim=True)
    std = lm.std(1, keepdim=True)  # n-1
    return ((lm - mean) / (std + 1e-5)).numpy()


def _one(job):
    i, path = job
    import soundfile as sf

    _setup()
    x, sr = sf.read(path, dtype="float32")
    if x.ndim > 1:
        x = x.mean(1)
    return i, nemo_log_mel(x), len(x)


class Writers:
    """``n`` writer threads taking whole shards from a queue of ``depth``."""

    def __init__(self, out, n=WRITERS, depth=WRITE_QUEUE):
        self.out = os.path.join(out, "shards")
        os.makedirs(self.out, exist_ok=True)
        self.q = queue.Queue(maxsize=depth)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def put(self, start, chunk):
        self.q.put((start, chunk))

    def _run(self):
        while True:
            job = self.q.get()
            if job is None:
                return
            start, chunk = job
            path = os.path.join(self.out,
                                f"shard-{start:06d}-{start + len(chunk) - 1:06d}.tar")
            with open(path + ".partial", "wb") as f:
                with tarfile.open(fileobj=f, mode="w") as tf:
                    for key, arr, meta in chunk:
                        for name, data in ((f"{key}.npy", _npy(arr)),
                                           (f"{key}.json", json.dumps(meta).encode())):
                            ti = tarfile.TarInfo(name)
                            ti.size = len(data)
                            tf.addfile(ti, io.BytesIO(data))
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".partial", path)

    def close(self):
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()


def _npy(arr):
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def run_torch(manifest, out, shard_size, mode):

    rows = read_manifest(manifest)
    jobs = list(enumerate(r["audio_filepath"] for r in rows))
    writers = Writers(out)
    index = []
    _setup()  # the filters once, before the workers fork
    if mode == "p2":
        import multiprocessing as mp

        pool = mp.get_context("fork").Pool(2, initializer=_setup)
        results = pool.imap(_one, jobs, chunksize=4)
    else:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(2)
        results = pool.map(_one, jobs)
    chunk, start = [], 0
    for i, feats, n in results:
        key = f"{i:09d}"
        meta = {**rows[i], "index": i, "shape": list(feats.shape), "dtype": str(feats.dtype),
                "num_samples": int(n)}
        chunk.append((key, feats, meta))
        index.append({"index": i, "key": key, "shape": list(feats.shape)})
        if len(chunk) == shard_size:
            writers.put(start, chunk)
            chunk, start = [], i + 1
    if chunk:
        writers.put(start, chunk)
    writers.close()
    if mode == "p2":
        pool.close()
        pool.join()
    else:
        pool.shutdown()
    with open(os.path.join(out, "index.jsonl"), "w") as f:
        for r in index:
            f.write(json.dumps(r) + "\n")
    return {"mode": mode, "writers": WRITERS}


def run_avpipe(manifest, out, shard_size):
    from avpipe.recipes.extract import run_extract

    s = run_extract(manifest, preset="nemo", out_dir=out, devices="cpu", shard_size=shard_size,
                    progress=False)
    assert s.complete and s.errors == 0, s.format()
    return {"devices": s.devices, "shards": s.shards_total}


# --- checks -----------------------------------------------------------------------------------


def read_shards(out):
    """``{key: array}`` of every ``KEY.npy`` in ``out/shards/*.tar``."""
    d = os.path.join(out, "shards")
    arrays = {}
    for name in sorted(os.listdir(d)):
        if not name.endswith(".tar"):
            continue
        with tarfile.open(os.path.join(d, name)) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".npy"):
                    arrays[m.name[:-4]] = np.load(io.BytesIO(tf.extractfile(m).read()))
    return arrays


def compare(a_dir, b_dir):
    a, b = read_shards(a_dir), read_shards(b_dir)
    same_keys = sorted(a) == sorted(b)
    shapes = all(a[k].shape == b[k].shape for k in a if k in b)
    diffs = [float(np.abs(a[k] - b[k]).max()) for k in a if k in b and a[k].shape == b[k].shape]
    return {"items": len(a), "same_keys": same_keys, "same_shapes": shapes,
            "dtype": sorted({str(v.dtype) for v in a.values()}),
            "max_abs_diff": max(diffs) if diffs else None,
            "mean_max_abs_diff": float(np.mean(diffs)) if diffs else None,
            "within_1e-3": bool(diffs) and max(diffs) <= 1e-3 and same_keys and shapes}



# --- harness ----------------------------------------------------------------------------------

NAME = "cpu_extract"
SUITE = "cpu"
UNIT = "audio-s/s"
TITLE = ("avpipe extract --preset nemo --devices cpu over 256 FLAC of 2-16 s into tar shards of "
         "64, each run a fresh process, from the call to the last shard written")
CONTENDERS = {
    "avpipe": "run_extract(preset=nemo, devices=cpu, shard_size=64): default workers, 4 writer "
              "threads",
    "torch_p2": "soundfile + torch NeMo log-mel per file in 2 processes, 4 writer threads "
                "(fsync + rename per shard)",
    "torch_t2": "the same script in 2 threads, 4 writer threads",
    "avpipe_profiled": "avpipe's run with AVPIPE_EXTRACT_PROFILE=1 (a profile, not a contender)",
}
OPTIONAL = ("avpipe_profiled",)
BEST_OF = {"torch_best": ["torch_p2", "torch_t2"]}
RATIOS = [("avpipe", "torch_best"), ("avpipe", "torch_p2"), ("avpipe", "torch_t2")]
PARAMS = {"files": 256, "shard_size": 64}
QUICK = {"files": 16, "shard_size": 8}
REQUIRES = ("torch", "librosa")


def prepare(ctx):
    d = bdata.cpu_flac(ctx.data_dir, ctx.params["files"])
    return {"manifest": d["manifest"], "work": os.path.join(ctx.data_dir, "extract_out")}


def one_run(name, manifest, out, shard_size):
    """One contender's job into ``out`` (emptied first), timed: the measurement's fields."""
    import torch  # noqa: F401 - imported before the clock, as avpipe's own imports

    import avpipe.recipes.extract  # noqa: F401

    shutil.rmtree(out, ignore_errors=True)
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    if name == "avpipe":
        extra = run_avpipe(manifest, out, shard_size)
    else:
        extra = run_torch(manifest, out, shard_size, name.split("_")[1])
    secs = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    audio_s = sum(float(m["duration"]) for m in read_manifest(manifest))
    return {"value": audio_s / secs, "seconds": round(secs, 3), "cpu_s": round(cpu, 3),
            "audio_s_per_cpu_s": round(audio_s / cpu, 2), "audio_seconds": round(audio_s, 1),
            **extra}


def measure(ctx, name):
    manifest, shard = ctx.data["manifest"], ctx.params["shard_size"]
    if name == "avpipe_profiled":
        args = SimpleNamespace(manifest=manifest, shard_size=shard, work=ctx.data["work"])
        out = profile(args, dict(os.environ))
        return (out.get("avpipe_run") or {}).get("value"), out
    r = one_run(name, manifest, os.path.join(ctx.data["work"], name), shard)
    return r.pop("value"), r


def finish(ctx):
    """The last round's shards of each script contender against avpipe's."""
    work = ctx.data["work"]
    a = os.path.join(work, "avpipe")
    if not os.path.isdir(a):
        return {}
    return {"outputs": {n: compare(a, os.path.join(work, n)) for n in ("torch_p2", "torch_t2")
                        if os.path.isdir(os.path.join(work, n))}}


def profile(args, env):
    """avpipe's own stage timer (``AVPIPE_EXTRACT_PROFILE=1``: the worker's seconds per stage,
    printed by the worker process) on one run, next to the script's stages on one thread
    (read, log-mel, npy + tar bytes) over the same files."""
    e = dict(env, AVPIPE_EXTRACT_PROFILE="1")
    work = os.path.join(args.work, "avpipe_profile")
    code = ("import json,sys; from benchmarks.workloads import cpu_extract as w; "
            "print('RESULT ' + json.dumps(w.one_run(sys.argv[1], sys.argv[2], sys.argv[3], "
            "int(sys.argv[4]))))")
    cmd = [sys.executable, "-c", code, "avpipe", args.manifest, work, str(args.shard_size)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=900, cwd=ROOT)
    wall = time.perf_counter() - t0
    res = next((json.loads(x[len("RESULT "):]) for x in p.stdout.splitlines()
                if x.startswith("RESULT ")), None)
    stages = {}
    for line in (p.stderr + p.stdout).splitlines():
        if "avpipe extract profile" in line:
            for part in line.split(": ", 1)[1].split(", "):  # "name 1.23 s"
                name, _, val = part.rpartition(" ")[0].rpartition(" ")
                stages[name] = round(float(val), 3)
    shutil.rmtree(work, ignore_errors=True)
    import soundfile as sf

    _setup()
    t = {"read (soundfile.read)": 0.0, "log-mel (torch float32, per item)": 0.0,
         "npy + tar member bytes": 0.0}
    for r in read_manifest(args.manifest):
        t0 = time.perf_counter()
        x, _ = sf.read(r["audio_filepath"], dtype="float32")
        t1 = time.perf_counter()
        f = nemo_log_mel(x)
        t2 = time.perf_counter()
        b = io.BytesIO()
        with tarfile.open(fileobj=b, mode="w") as tf:
            data = _npy(f)
            ti = tarfile.TarInfo("k.npy")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        t3 = time.perf_counter()
        t["read (soundfile.read)"] += t1 - t0
        t["log-mel (torch float32, per item)"] += t2 - t1
        t["npy + tar member bytes"] += t3 - t2
    return {"avpipe_run": res, "avpipe_process_wall_s": round(wall, 3),
            "avpipe_stages_s": stages,
            "script_serial_stages_s": {k: round(v, 3) for k, v in t.items()}}


