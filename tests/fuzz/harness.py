"""Run fuzz cases through every public decoder in replaceable worker processes.

Work goes out in *units*: one backend and a list of cases (damaged files, with clean seed files
interleaved so that a good file decoded after bad ones is checked in the same process). Each
worker process is long-lived (one Python start and one import per worker, not per case) and
reports every case as it starts and ends. A worker that dies (a signal, a native abort) or
that exceeds the per-case time limit is killed and replaced; the case it was on is run again
alone in a fresh worker to confirm, and the rest of its unit goes back in the queue.

Outcomes per case and backend:

* ``decoded`` / ``decoded_damaged`` (the result carries a damage flag) / ``typed_error``
  (:class:`avpipe.DecodeError` or FileNotFoundError) / ``skipped`` (a batch API reported the
  item in its errors) — all fine;
* ``hang``, ``crash`` (confirmed alone), ``hang_in_sequence`` / ``crash_in_sequence`` (only
  after other cases), ``untyped_error``, ``good_failed`` (a clean file that did not decode
  cleanly, e.g. after bad ones), ``unaccounted`` (a training feed neither put the case in a
  batch nor reported it in ``feed.errors``, or did both, or listed it in ``feed.errors`` but in no
  batch's ``errors``; a training feed may repeat a good item to fill its last batches),
  ``nonfinite`` (a feed's batch row of the case holds NaN / infinite values), ``silent_damage``
  (a case of damage every decoder can tell, ``expect="damaged"``, decoded with neither an error
  nor a damage note), ``not_refused`` (a case the corpus marks ``expect="refused[:Class]"``,
  e.g. a JPEG 2000 tile size of 0 or a decompression bomb over the pixel cap, decoded, or failed
  with another error class) — failures.

The training feeds (``FEED_CPU_BACKENDS`` / ``FEED_GPU_BACKENDS``: ``rnnt_feed``,
``video_classification``, ``image_classification``) take a whole unit at once: one manifest /
CSV listing the unit's damaged files with the clean seeds between and after them, one feed, one
epoch (:func:`run_feed_unit`). A feed unit that crashes or hangs has each of its cases run
again alone (one feed of the case and its family's clean seed, in a fresh worker): the ones
that fail alone are the culprits; when none does, every case of the unit is recorded as
``crash_in_sequence`` / ``hang_in_sequence``.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections import Counter, deque
from multiprocessing.connection import wait

FAILING = ("hang", "crash", "hang_in_sequence", "crash_in_sequence", "untyped_error", "good_failed",
           "unaccounted", "nonfinite", "not_refused", "not_run", "silent_damage")
OK = ("decoded", "decoded_damaged", "typed_error", "skipped")

# backend -> the case kinds it takes
CPU_BACKENDS = {
    "video_cpu": "video",
    "audio_cpu": "audio",
    "image_cpu": "image",
    "image_stream_cpu": "image",
    "audio_batch_cpu": "audio",
}
GPU_BACKENDS = {
    "video_cuda": "video",
    "audio_cuda": "audio",
    "image_cuda": "image",
    "image_stream_cuda": "image",
    "audio_batch_gpu": "audio",
}
# the training feeds (avpipe.recipes): a unit of cases through one feed, one epoch
FEED_CPU_BACKENDS = {
    "rnnt_feed_cpu": "audio",
    "video_feed_cpu": "video",
    "image_feed_cpu": "image",
}
FEED_GPU_BACKENDS = {
    "rnnt_feed_cuda": "audio",
    "video_feed_cuda": "video",
    "image_feed_cuda": "image",
}
FEED_BACKENDS = {**FEED_CPU_BACKENDS, **FEED_GPU_BACKENDS}


def usable(backends: dict) -> tuple[dict, list[str]]:
    """``backends`` without those whose decoders do not import here, and why each was left out:
    the image backends need DALI (CPU) and nvImageCodec (GPU), which a machine may lack; a
    missing decoder library is the machine's state, not the files' fault."""
    import importlib.util

    def missing(name):
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    out, left = {}, []
    for name, kind in backends.items():
        need = []
        if kind == "image":
            need = ["nvidia.dali"] + (["nvidia.nvimgcodec"] if "cuda" in name else [])
        gone = [m for m in need if missing(m)]
        if gone:
            left.append(f"{name}: {', '.join(gone)} does not import here")
        else:
            out[name] = kind
    return out, left


def entry_points():
    """The batch APIs that are not top-level names of ``avpipe``: the one place that imports
    them, ``(decode_image_stream, AudioBatchLoader)``."""
    from avpipe.pipeline.audio_loader import AudioBatchLoader
    from avpipe.pipeline.image_stream import decode_image_stream

    return decode_image_stream, AudioBatchLoader


# --- one case in the worker ----------------------------------------------------------------------


def _host(a):
    return a.get() if hasattr(a, "get") and not hasattr(a, "__array_interface__") else a


def _video(path, device):
    import numpy as np

    import avpipe

    with avpipe.VideoDecoder(path, device=device) as dec:
        m = dec.metadata
        n = len(dec)
        b = dec.get_frames(sorted({0, n // 2, n - 1}))
        assert _host(b.data).shape[0] == len({0, n // 2, n - 1})
        b2 = dec.get_frames_at([m.begin_seconds, (m.begin_seconds + m.end_seconds) / 2])
        assert np.asarray(_host(b2.data)).ndim == 4
        damaged = getattr(m, "damaged", None) or getattr(b, "damaged", None)
        damaged = damaged or getattr(b2, "damaged", None) or getattr(dec, "damaged", None)
        return {"damaged": damaged, "info": f"{dec.backend} n={n}"}


def _audio(path, device):
    import avpipe

    a = avpipe.load_audio(path, device=device)
    return {"damaged": getattr(a, "damaged", None), "info": f"n={a.num_samples}"}


def _image(path, device):
    import avpipe

    im = avpipe.decode_images([path], device=device)[0]
    return {"damaged": None, "info": f"{tuple(im.shape)}"}


def _in_batch(errors, images_ok, bad_index=1):
    """A batch API's view of [good, bad, good]: the good ones must come back."""
    import avpipe

    if not all(images_ok[i] for i in range(len(images_ok)) if i != bad_index):
        raise _GoodFailed(f"a good item around the bad one failed: {errors!r}")
    if bad_index in errors:
        e = errors[bad_index]
        if isinstance(e, BaseException) and not isinstance(e, avpipe.DecodeError):
            raise e
        return {"skipped": True, "damaged": None, "info": f"{type(e).__name__}: {e}"[:300]}
    return {"damaged": None, "info": "decoded in a batch"}


def _image_stream(path, device, good):
    stream, _ = entry_points()
    errors, ok = {}, []
    for b in stream([good, path, good], batch_size=3, device=device):
        k0 = len(ok)
        errors.update({k0 + i: e for i, e in b.errors})
        ok.extend(im is not None for im in b.images)
    return _in_batch(errors, ok)


def _audio_batch(path, device, good):
    _, Loader = entry_points()
    gpu = device != "cpu"
    loader = Loader([good, path, good], batch_size=3, device=device, num_workers=1,
                    decoder="gpu" if gpu else "cpu", timeout=20.0)  # fmt: skip
    try:
        errors, ok = {}, []
        for _x, lengths, _p, errs in loader.batches():
            errors.update(errs)
            ok.extend(int(n) > 0 for n in lengths)
    finally:
        loader.close()
    r = _in_batch(errors, ok)
    if not r.get("skipped"):
        r["damaged"] = getattr(loader, "damaged", {}).get(path)
    return r


class _GoodFailed(Exception):
    pass


def refusal_rule(case, outcome: str, text: str):
    """A case the corpus marks ``expect="refused"`` / ``"refused:<ErrorClass>"`` must come back
    as a typed error (``typed_error``, or ``skipped`` by a batch API or a feed), of that class
    when one is named (``text`` holds the error, its class name first); otherwise
    ``("not_refused", why)``. Other cases and failing outcomes: ``(outcome, None)``."""
    want = case.get("expect") or ""
    if not want.startswith("refused") or outcome in FAILING:
        return outcome, None
    cls = want.partition(":")[2]
    if outcome not in ("typed_error", "skipped"):
        return "not_refused", f"{outcome}: it should have been refused ({cls or 'a typed error'})"
    if cls and cls not in (text or ""):
        return "not_refused", f"refused, but not with {cls}: {text[:300]}"
    return outcome, None


def run_case(backend: str, case: dict, goods: dict) -> dict:
    """Decode one case with one backend; never raises."""
    import avpipe

    path = case["path"]
    dev = "cpu" if backend.endswith("_cpu") else "cuda"
    good = goods.get(case["family"])
    t0 = time.perf_counter()
    try:
        if backend.startswith("video"):
            r = _video(path, dev)
        elif backend.startswith("audio_batch"):
            r = _audio_batch(path, dev, good)
        elif backend.startswith("audio"):
            r = _audio(path, dev)
        elif backend.startswith("image_stream"):
            r = _image_stream(path, dev, good)
        else:
            r = _image(path, dev)
        out = "skipped" if r.pop("skipped", False) else (
            "decoded_damaged" if r.get("damaged") else "decoded")  # fmt: skip
    except _GoodFailed as e:
        r, out = {"error": str(e)}, "good_failed"
    except (avpipe.DecodeError, FileNotFoundError) as e:
        r, out = {"error": f"{type(e).__name__}: {e}"[:500]}, "typed_error"
    except Exception as e:  # noqa: BLE001 - what the fuzz run looks for
        tb = traceback.format_exc(limit=6)
        r, out = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": tb[-2000:]}, "untyped_error"
    if case.get("expect") == "good" and out != "decoded":  # a clean file skipped is a failure
        r.setdefault("error", f"clean file gave {out}: {r.get('damaged')}")
        out = "good_failed"
    out = _silent_rule(case, out, r)
    out, why = refusal_rule(case, out, r.get("error") or r.get("info") or "")
    if why is not None:
        r["error"] = why
    r["outcome"] = out
    r["seconds"] = round(time.perf_counter() - t0, 4)
    return r


# --- a unit of cases through a training feed ---------------------------------------------------

# settings per feed: small batches, the training path (augmentation on)
FEED_SETTINGS = {
    "rnnt": dict(batch_size=4, training=True),
    "video": dict(clip_length=4, stride=1, crop_size=32, batch_size=2, train=True),
    "image": dict(crop_size=32, resize_size=40, batch_size=4, train=True),
}
GOOD_EVERY = 3  # a clean seed listed after every GOOD_EVERY damaged files


# A feed unit holding a ``blocking_read`` case (:func:`corpus.blocking_cases`: a named pipe with
# a media name, which the worker takes for a regular file: its read never returns, as on a
# stalled network mount) runs its feed with this per-item deadline. The case is handled when it
# comes back ``skipped`` with a DecodeTimeoutError in ``feed.errors`` well within the case
# timeout, and the worker goes on with its next unit (the stuck thread is left behind).
BLOCKING_DEADLINE_S = 2.0
# feeds whose reads can be abandoned (the image feed's DALI reader cannot: not given these)
BLOCKING_FEEDS = ("rnnt", "video")


def _pipes_as_files():
    """In this worker: avpipe takes named pipes for regular files (tests/_support/stalls.py)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_support")
    if here not in sys.path:
        sys.path.insert(0, here)
    from stalls import treat_pipes_as_files

    treat_pipes_as_files()


def _warm_up(kind, seeds):
    """Decode the clean seeds once in this worker: a decoder's first use (libraries loaded,
    codecs set up: a second or more on a busy machine) is not charged to a feed item's short
    deadline."""
    import avpipe

    for p in seeds:
        try:
            if kind == "video":
                with avpipe.VideoDecoder(p, device="cpu") as dec:
                    dec.get_frames([0])
            else:
                avpipe.load_audio(p)
        except Exception:  # noqa: BLE001 - the feed reports it
            pass


def _duration(path):
    """Seconds for the manifest: soundfile's, else PyAV's, else 0.5 (a damaged header is part
    of the test: an absurd but positive duration stays). A pipe is not read (0.5)."""
    import math
    import stat

    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            return 0.5
    except OSError:
        pass
    d = None
    try:
        import soundfile as sf

        i = sf.info(path)
        d = i.duration
        if i.frames > 512 * max(os.path.getsize(path), 1):  # no count (a streamed FLAC)
            raise ValueError("the header gives no sample count")
    except Exception:  # noqa: BLE001 - any failure: try PyAV
        d = None
        try:
            import av

            with av.open(path) as c:
                if c.duration is not None:
                    d = c.duration / 1e6
                elif c.streams.audio and c.streams.audio[0].duration is not None:
                    st = c.streams.audio[0]
                    d = float(st.duration * st.time_base)
        except Exception:  # noqa: BLE001
            d = None
    try:
        d = float(d)
    except (TypeError, ValueError):
        return 0.5
    return d if math.isfinite(d) and d > 0 else 0.5


def _listing(cases, goods):
    """The feed's list of paths: the cases in order, after every :data:`GOOD_EVERY` damaged
    ones the clean seed of the last one's family, and at the end the seed of every family of
    the unit (the unit's ``good:`` case, when it has one, is that last entry)."""
    out, bad, listed = [], 0, set()
    for c in cases:
        out.append(c["path"])
        if c.get("damage") == "good_after_bad":
            listed.add(c["path"])
        if c.get("expect") != "good":
            bad += 1
            seed = goods.get(c["family"])
            if seed and bad % GOOD_EVERY == 0:
                out.append(seed)
    for fam in sorted({c["family"] for c in cases}):
        seed = goods.get(fam)
        if seed and seed not in listed:
            out.append(seed)
    return out


def _write_list(kind, entries, folder):
    """The manifest (NeMo JSON lines) / CSV ``path,label`` of the paths ``entries``, relative
    to it; returns its path."""
    import json

    if kind == "rnnt":
        p = os.path.join(folder, "manifest.json")
        with open(p, "w", encoding="utf-8") as f:
            for k, path in enumerate(entries):
                f.write(json.dumps({"audio_filepath": os.path.relpath(path, folder),
                                    "duration": _duration(path), "text": f"item {k}"}) + "\n")
        return p
    p = os.path.join(folder, "list.csv")
    with open(p, "w", encoding="utf-8") as f:
        f.write("path,label\n")
        for path in entries:
            label = os.path.basename(os.path.dirname(path)) or "x"
            f.write(f"{os.path.relpath(path, folder)},{label}\n")
    return p


def _feed_kind(backend):
    return backend.split("_feed")[0]


def _make_feed(backend, listing, device, **extra):
    from avpipe import recipes

    kind = _feed_kind(backend)
    st = {**FEED_SETTINGS[kind], **extra}
    if kind == "rnnt":
        return recipes.rnnt_feed(listing, device=device, shuffle=False, **st)
    if kind == "video":
        return recipes.video_classification(listing, device=device, shuffle=False, **st)
    return recipes.image_classification(listing, device=device, shuffle=False, **st)


def _check_batch(kind, b, st):
    """The batch contract; returns ``{row: valid frames or None}`` of rows with non-finite
    values (checked over the valid part)."""
    import numpy as np

    n = len(b.paths)  # 0: evaluation, every item of a last batch failed (or rank padding)
    cap = st.get("batch_size") or 10**9  # max_duration: any count
    assert 0 <= n <= cap, f"batch of {n} items (batch_size {cap})"
    assert len(b.ids) == n, f"{len(b.ids)} ids for {n} paths"
    bad = {}
    if kind == "rnnt":
        x = np.asarray(_host(b.features))
        fl = np.asarray(_host(b.feature_lengths))
        assert x.ndim == 3 and x.shape[0] == n and fl.shape == (n,), (x.shape, fl.shape)
        assert len(b.transcripts) == n
        assert (fl >= 0).all() and (fl <= x.shape[2]).all(), f"feature_lengths {fl} > T"
        for r in range(n):
            if not np.isfinite(x[r, :, : int(fl[r])]).all():
                bad[r] = int(fl[r])
        return bad
    T, S = st.get("clip_length"), st["crop_size"]
    x = np.asarray(_host(b.clips if kind == "video" else b.images))
    want = (n, T, 3, S, S) if kind == "video" else (n, 3, S, S)
    assert x.shape == want, f"array {x.shape}, want {want}"
    lab = np.asarray(_host(b.labels))
    assert lab.shape == (n,), f"labels {lab.shape}"
    for r in range(n):
        if not np.isfinite(x[r].astype(np.float32)).all():
            bad[r] = None
    return bad


def run_feed_unit(backend, cases, goods):
    """A unit of cases through one training feed (see the module docstring); one result per
    case. Accounting is per file: each of its feed items (one, or an eval video's views) must
    be in exactly one batch row or reported once in ``feed.errors``, with a message; a file is
    ``decoded`` (all its items in batches), ``skipped`` (all reported) or ``decoded_damaged``
    (some of each). An exception escaping the epoch is pinned on a case by running each case
    alone (one feed of it and its family's seed): the ones that raise alone; when none does,
    every case of the unit."""
    import shutil
    import tempfile

    dev = "cpu" if backend.endswith("_cpu") else "cuda"
    kind = _feed_kind(backend)
    st = FEED_SETTINGS[kind]
    t0 = time.perf_counter()
    entries = _listing(cases, goods)
    folder = tempfile.mkdtemp(prefix="avpipe-fuzz-feed-")
    feed = None
    extra = {}
    if any(c.get("damage") == "blocking_read" for c in cases):
        if kind not in BLOCKING_FEEDS:
            raise ValueError(f"blocking_read cases are for the {BLOCKING_FEEDS} feeds only")
        _pipes_as_files()
        _warm_up(kind, [goods[f] for f in sorted({c["family"] for c in cases}) if goods.get(f)])
        extra["deadline"] = BLOCKING_DEADLINE_S
    try:
        feed = _make_feed(backend, _write_list(kind, entries, folder), dev, **extra)
        in_batch, nonfinite, zero_len = {}, set(), set()
        batch_errors = set()  # the (path, message) pairs the batches carry
        repeats = feed.pad == "repeat"  # a training feed fills its last batches with repeats
        for b in feed:
            batch_errors.update(tuple(e) for e in b.errors)
            bad = _check_batch(kind, b, st)
            ids = [int(i) for i in _host(b.ids)]
            for r, i in enumerate(ids):
                in_batch[i] = in_batch.get(i, 0) + 1
                if r in bad:
                    nonfinite.add(i)
            if kind == "rnnt":
                fl = _host(b.feature_lengths)
                zero_len.update(i for r, i in enumerate(ids) if int(fl[r]) == 0)
        errors = {}
        for path, msg in feed.errors:
            errors.setdefault(path, []).append(msg)
        items = list(feed.items)
    except Exception as e:  # noqa: BLE001 - the epoch raised: find the case
        tb = traceback.format_exc(limit=8)[-2000:]
        err = f"{type(e).__name__}: {e}"[:500]
        if len(cases) == 1:
            r = {"outcome": "untyped_error", "error": f"the feed raised {err}", "traceback": tb}
            return [_good_rule(cases[0], r, t0)]
        alone = [run_feed_unit(backend, [c], goods)[0] for c in cases]
        if any(a["outcome"] == "untyped_error" for a in alone):
            return alone
        return [_good_rule(c, {"outcome": "untyped_error", "traceback": tb,
                               "error": f"the feed over {len(cases)} cases raised {err}; "
                                        "no case alone does"}, t0) for c in cases]
    finally:
        if feed is not None:
            feed.close()
        shutil.rmtree(folder, ignore_errors=True)

    by_path = {}  # the feed's paths (absolute) -> its item ids
    for j, it in enumerate(items):
        by_path.setdefault(it.path, []).append(j)
    listed = {os.path.abspath(p) for p in entries}
    status = {}  # listed path -> (outcome, text)
    for p, ids in by_path.items():
        # items of the file in a batch (a training feed may repeat one: counted once); the
        # others must be in feed.errors, which lists each (path, message) once
        got = sum(1 for j in ids if in_batch.get(j, 0))
        msgs = errors.get(p, [])
        twice = not repeats and any(in_batch.get(j, 0) > 1 for j in ids)
        if twice or (got < len(ids)) != bool(msgs):
            how = "neither in a batch nor in feed.errors" if got < len(ids) else \
                "both in a batch and in feed.errors (or twice)"
            status[p] = ("unaccounted", f"{len(ids)} items, {got} in batches, {len(msgs)} "
                                        f"errors: {how} {msgs[:1]!r}")
        elif any((p, m) not in batch_errors for m in msgs):
            status[p] = ("unaccounted", f"in feed.errors but in no batch's errors: {msgs[:1]!r}")
        elif not all(str(m).strip() for m in msgs):
            status[p] = ("unaccounted", f"reported without a message: {msgs!r}")
        elif any(j in nonfinite for j in ids):
            status[p] = ("nonfinite", "a batch row of it holds NaN / inf")
        elif got == len(ids):
            status[p] = ("decoded", "zero feature frames" if any(j in zero_len for j in ids)
                         else "")  # fmt: skip
        elif got == 0:
            status[p] = ("skipped", msgs[0][:300])
        else:
            status[p] = ("decoded_damaged", f"{got} of {len(ids)} items decoded; {msgs[0][:250]}")
    for p in listed - set(status):  # no feed item: left out up front (rnnt's max_duration)
        msgs = errors.get(p, [])
        status[p] = (("skipped", msgs[0][:300]) if msgs and all(str(m).strip() for m in msgs)
                     else ("unaccounted", f"no feed item and errors {msgs!r}"))
    seeds = {os.path.abspath(goods[c["family"]]) for c in cases if goods.get(c["family"])}
    seeds_ok = all(status[p][0] == "decoded" for p in seeds if p in status)
    out = []
    for c in cases:
        o, text = status[os.path.abspath(c["path"])]
        if c.get("damage") == "good_after_bad" or c.get("expect") == "good":
            n = len(by_path.get(os.path.abspath(c["path"]), ()))
            r = ({"outcome": "decoded", "info": f"{n} items decoded"} if o == "decoded" else
                 {"outcome": "good_failed", "error": f"the clean file ({n} items): {o}: {text}"})
        elif o in FAILING:
            r = {"outcome": o, "error": text}
        elif c.get("damage") == "blocking_read" and not (
                o == "skipped" and text.startswith("DecodeTimeoutError")):
            r = {"outcome": "hang", "error": f"a read that never returns gave {o}: {text}"}
        else:
            r = {"outcome": o, "damaged": None, "info": text}
            o2, why = refusal_rule(c, o, text)
            if why is not None:
                r = {"outcome": o2, "error": why}
        if r["outcome"] in OK and not seeds_ok:
            r = {"outcome": "good_failed", "error": "the clean seed listed beside it failed: "
                 + repr({p: status[p] for p in seeds if p in status})[:300]}
        out.append(_good_rule(c, r, t0))
    return out


def _silent_rule(case, outcome, r):
    """``silent_damage`` for damage that must be reported (``expect="damaged"``) but was
    decoded with no error and no damage note; else ``outcome``."""
    if case.get("expect") == "damaged" and outcome == "decoded":
        r.setdefault("error", f"decoded with no error and no damage note: {case.get('detail')}")
        return "silent_damage"
    return outcome


def _good_rule(case, r, t0):
    if case.get("expect") == "good" and r["outcome"] != "decoded":
        r.setdefault("error", f"clean file gave {r['outcome']}")
        r["outcome"] = "good_failed"
    r["outcome"] = _silent_rule(case, r["outcome"], r)
    r["seconds"] = round(time.perf_counter() - t0, 4)
    return r


def _worker(conn, log_path, dali_threads=None):
    """Worker loop: units in, ("start", i) / ("done", i, result) / ("end",) out.
    ``dali_threads``: DALI CPU threads per pipeline in this worker (the workers share the
    machine's cores: DALI's default, one per core, in every worker oversubscribes them)."""
    if dali_threads and "AVPIPE_DALI_THREADS" not in os.environ:
        os.environ["AVPIPE_DALI_THREADS"] = str(dali_threads)
    if log_path:  # native libraries' chatter goes to the worker's log, not the console
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    import avpipe  # noqa: F401 - import once per worker

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        backend, cases, goods = msg
        if backend in FEED_BACKENDS:  # the whole unit through one feed
            conn.send(("start", 0))
            for i, r in enumerate(run_feed_unit(backend, cases, goods)):
                conn.send(("done", i, r))
            conn.send(("end",))
            continue
        for i, case in enumerate(cases):
            conn.send(("start", i))
            conn.send(("done", i, run_case(backend, case, goods)))
        conn.send(("end",))


# --- the scheduler ----------------------------------------------------------------------------

EXIT_S = 5.0  # a worker told to end exits within this, else it is killed


class _Slot:
    def __init__(self, ctx, log_dir, k, dali_threads=None):
        self.parent, child = ctx.Pipe()
        self.dali_threads = dali_threads
        log = os.path.join(log_dir, f"worker{k}.log") if log_dir else None
        self.proc = ctx.Process(target=_worker, args=(child, log, dali_threads), daemon=False)
        self.proc.start()
        child.close()
        self.unit = None
        self.current = None
        self.started = 0.0
        self.backend = None  # a worker serves one backend (DALI's memory makes forks fail)

    def kill(self):
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.join(5)
        self.parent.close()


def make_units(cases, backends: dict, seeds: dict, chunk: int = 16, sequences=()):
    """Units ``(backend, [cases], goods)``: each backend's cases of its kind in chunks of
    ``chunk``, each chunk followed by the clean seed of every family it touched; plus the given
    ``sequences`` (``(backend, [cases])``, run in order in one worker)."""
    units = []
    for backend, kind in backends.items():
        mine = [c for c in cases if c["kind"] == kind]
        goods = {c["family"]: seeds[c["family"]] for c in mine}
        for s in range(0, len(mine), chunk):
            part = list(mine[s : s + chunk])
            fams = sorted({c["family"] for c in part})
            part += [good_case(f, seeds, kind) for f in fams]
            units.append((backend, part, goods))
    for backend, seq in sequences:
        goods = {c["family"]: seeds.get(c["family"]) for c in seq}
        units.append((backend, list(seq), goods))
    return units


def good_case(family, seeds, kind):
    return dict(id=f"good:{family}", family=family, kind=kind, path=seeds[family],
                damage="good_after_bad", detail="", expect="good")  # fmt: skip


def run_units(units, *, workers=None, case_timeout=30.0, log_dir=None, progress=True,
              budget_s=None, exits=None):
    """Run the units; returns one record per (backend, case) run.

    ``budget_s``: wall seconds for the whole run; past it the workers are killed and every case
    not yet recorded gets the failing outcome ``not_run`` (a run that cannot finish says so,
    and which cases it did not reach, instead of blocking its caller). ``log_dir`` also gets
    ``records.jsonl``, one line per record as it is made (what a killed run had reached).
    ``exits``: a list that gets, per worker at the end, whether it exited by itself within
    ``EXIT_S`` of being told to (a thread left stuck in a read must not hold its exit)."""
    ctx = mp.get_context("spawn")
    workers = max(1, int(workers or os.cpu_count() or 1))
    dali_threads = max(1, (os.cpu_count() or 1) // workers)  # the cores shared among workers
    queue = deque(units)
    confirm = deque()  # (backend, case, goods, how, reason, group) to re-run alone
    groups: dict = {}  # a failed feed unit's cases re-run alone: group -> (n, [(case, r)])
    records = []
    slots: list[_Slot] = []
    counter = itertools.count(10_000)
    k = 0
    total = sum(len(u[1]) for u in units)
    done = 0
    t0 = time.monotonic()
    last_print = 0.0

    journal = open(os.path.join(log_dir, "records.jsonl"), "a") if log_dir else None

    def record(backend, case, r):
        nonlocal done
        done += 1
        rec = dict(backend=backend, id=case["id"], family=case["family"], damage=case["damage"],
                   detail=case.get("detail", ""), path=case["path"], **r)  # fmt: skip
        records.append(rec)
        if journal is not None:
            journal.write(json.dumps(rec, default=str) + "\n")
            journal.flush()

    def assign(slot):
        if confirm:
            backend, case, goods, how, reason, group = confirm.popleft()
            slot.unit = (backend, [case], goods, ("confirm", how, reason, group))
        elif queue:
            pick = next((i for i, u in enumerate(queue) if u[0] == slot.backend), None)
            if pick is None and slot.backend is not None:  # a fresh worker for another backend
                slot.parent.send(None)
                slot.proc.join(5)
                slot.kill()
                slot.__init__(ctx, log_dir, next(counter), slot.dali_threads)
            backend, cases, goods = queue[pick or 0]
            del queue[pick or 0]
            slot.unit = (backend, cases, goods, None)
            slot.backend = backend
        else:
            return False
        slot.current, slot.started = None, time.monotonic()
        slot.done_idx = set()
        slot.parent.send(slot.unit[:3])
        return True

    def fail(slot, how):
        """The slot's worker died or hung on its current case."""
        backend, cases, goods, conf = slot.unit
        i = slot.current if slot.current is not None else 0
        case = cases[i]
        code = slot.proc.exitcode
        slot.kill()
        reason = f"{how} (exit code {code})" if how == "crash" else f"{how} (> {case_timeout:g} s)"
        if conf is not None:  # already alone: confirmed
            conclude(backend, case, {"outcome": how, "error": reason}, conf)
        elif len(cases) == 1 and i == 0:
            record(backend, case, {"outcome": how, "error": reason + ", alone"})
        elif backend in FEED_BACKENDS:  # one feed over the unit: every case of it alone
            g = next(counter)
            groups[g] = (len(cases), [])
            for c in cases:
                confirm.append((backend, c, goods, how,
                                f"{reason} in a feed over {len(cases)} cases", g))  # fmt: skip
            return
        else:
            confirm.append((backend, case, goods, how, f"{reason} after {i} other cases", None))
        rest = cases[i + 1 :]
        if rest:
            queue.appendleft((backend, rest, goods))

    def finish_confirm(backend, case, r, conf):
        _, how, reason, _ = conf
        if r["outcome"] in FAILING:
            return r
        return {"outcome": f"{how}_in_sequence", "error": reason,
                "alone": r.get("outcome")}  # fmt: skip

    def conclude(backend, case, r, conf):
        """A confirmation run's result: recorded, or, for a feed unit's case, kept until the
        unit's cases have all run alone (the ones failing alone are the culprits; with none,
        every case is recorded as failing in sequence)."""
        g = conf[3]
        if g is None:
            record(backend, case, finish_confirm(backend, case, r, conf))
            return
        n, got = groups[g]
        got.append((case, r))
        if len(got) < n:
            return
        del groups[g]
        culprit = any(x["outcome"] in FAILING for _, x in got)
        for c, x in got:
            record(backend, c, x if culprit else finish_confirm(backend, c, x, conf))

    for _ in range(min(workers, len(units))):
        slots.append(_Slot(ctx, log_dir, k, dali_threads))
        k += 1
    for s in slots:
        if not assign(s):
            s.unit = None
    over_budget = False
    while any(s.unit is not None for s in slots):
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            over_budget = True
            break
        busy = [s for s in slots if s.unit is not None]
        now = time.monotonic()
        nearest = min(case_timeout - (now - s.started) for s in busy)
        ready = wait([s.parent for s in busy] + [s.proc.sentinel for s in busy],
                     timeout=max(0.05, nearest))  # fmt: skip
        for s in busy:
            dead = False
            try:
                while s.parent.poll():
                    msg = s.parent.recv()
                    if msg[0] == "start":
                        s.current, s.started = msg[1], time.monotonic()
                    elif msg[0] == "done":
                        backend, cases, goods, conf = s.unit
                        r = msg[2]
                        s.done_idx.add(msg[1])
                        if conf is not None:
                            conclude(backend, cases[msg[1]], r, conf)
                        else:
                            record(backend, cases[msg[1]], r)
                        s.current = None
                        s.started = time.monotonic()
                    elif msg[0] == "end":
                        conf = s.unit[3]
                        s.unit = None
                        if conf is not None:  # a confirmation worker is not reused
                            s.parent.send(None)
                            s.proc.join(5)
                            s.kill()
                            s.__init__(ctx, log_dir, k, dali_threads)
                            k += 1
                        break
            except (EOFError, OSError):
                dead = True
            if s.unit is None:
                if not assign(s):
                    pass
                continue
            if dead or (s.proc.sentinel in ready and not s.proc.is_alive()):
                fail(s, "crash")
            elif time.monotonic() - s.started > case_timeout:
                fail(s, "hang")
            else:
                continue
            s.__init__(ctx, log_dir, k, dali_threads)
            k += 1
            assign(s)
        if progress and time.monotonic() - last_print > 10:
            last_print = time.monotonic()
            print(f"  {done}/{total} cases, {time.monotonic() - t0:.0f} s", file=sys.stderr,
                  flush=True)  # fmt: skip
    for s in slots:
        if over_budget and s.unit is not None:
            s.kill()
            continue
        try:
            s.parent.send(None)
        except OSError:
            pass
        s.proc.join(EXIT_S)
        if exits is not None:
            exits.append(not s.proc.is_alive())
        if s.proc.is_alive():
            s.kill()
    if over_budget:  # every case not recorded: not run within the budget
        pending = [(b, cs) for b, cs, _ in queue]
        pending += [(s.unit[0], [c for i, c in enumerate(s.unit[1]) if i not in s.done_idx])
                    for s in slots if s.unit is not None]
        pending += [(c[0], [c[1]]) for c in confirm]
        pending += [(next(u[0] for u in units if c in u[1]), [c])
                    for _, got in groups.values() for c, _ in got]  # run, not concluded
        for backend, cases in pending:
            for c in cases:
                record(backend, c, {"outcome": "not_run",
                                    "error": f"not reached within the run's {budget_s:g} s budget"})
    if journal is not None:
        journal.close()
    return records


# --- the extract recipe over a folder -----------------------------------------------------------


def run_extract_folder(folder, out_dir, device="cpu", timeout=600.0, cases=(), max_crashes=50):
    """``avpipe extract`` (preset quickstart) over a folder of the cases' files, in a subprocess;
    one record per case: ``decoded`` when written, ``typed_error`` / ``untyped_error`` from
    errors.jsonl. When the run dies (a signal) or hangs, the file it was on (the first one in the
    recipe's order with no record) is recorded as ``crash`` / ``hang``, taken out of the folder,
    and the run resumes (the recipe skips what it wrote), so one bad file costs only itself."""
    import json
    import shutil
    import subprocess

    import avpipe.errors as E
    from avpipe.recipes.extract import resolve_inputs, resolve_preset
    from avpipe.recipes.extract._presets import extensions_of

    out_dir = os.fspath(out_dir)
    inp = out_dir + "_input"  # hard links to the cases' files (the recipe would walk seeds/)
    shutil.rmtree(inp, ignore_errors=True)
    by_rel = {}
    for c in cases:
        rel = f"{c['family']}/{os.path.basename(c['path'])}"
        os.makedirs(os.path.join(inp, c["family"]), exist_ok=True)
        try:
            os.link(c["path"], os.path.join(inp, rel))
        except OSError:
            shutil.copyfile(c["path"], os.path.join(inp, rel))
        by_rel[rel] = c
    backend = f"extract_{'cpu' if device == 'cpu' else 'cuda'}"
    typed = {n for n in dir(E) if isinstance(getattr(E, n), type)} | {"FileNotFoundError"}
    cmd = [sys.executable, "-m", "avpipe", "extract", inp, "--preset", "quickstart",
           "--out", out_dir, "--device", device]  # fmt: skip
    recs: dict = {}

    def rec(c, outcome, error=""):
        outcome, why = refusal_rule(c, outcome, error)
        error = why or error
        r = dict(backend=backend, id=c["id"], family=c["family"], damage=c["damage"],
                 detail=c.get("detail", ""), path=c["path"], outcome=outcome, error=error[:500])
        if c.get("expect") == "good" and outcome != "decoded":
            r["outcome"] = "good_failed"
        r["outcome"] = _silent_rule(c, r["outcome"], r)
        recs[c["id"]] = r

    def collect():
        for name, written in (("errors.jsonl", False), ("index.jsonl", True)):
            try:
                f = open(os.path.join(out_dir, name))
            except OSError:
                continue
            with f:
                for line in f:
                    e = json.loads(line)
                    c = by_rel.get(e["source"])
                    if c is None:
                        continue
                    if written and e.get("status", "ok") != "ok":
                        continue  # index.jsonl lists failed inputs too: errors.jsonl has them
                    if written:
                        rec(c, "decoded")
                    else:
                        ok = e["error"] in typed
                        rec(c, "typed_error" if ok else "untyped_error",
                            f"{e['error']}: {e['message']}")  # fmt: skip

    for _ in range(max_crashes + 1):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            how = "crash" if p.returncode < 0 else None
            err = f"exit code {p.returncode}: {p.stderr[-300:]}"
        except subprocess.TimeoutExpired:
            how, err = "hang", f"> {timeout:g} s"
        collect()  # errors.jsonl holds only the latest run's errors: gather after each run
        if how is None:
            if p.returncode != 0:
                base = dict(backend=backend, family="*", damage="*", detail="", path=inp)
                return [*recs.values(), dict(base, id="extract", outcome="untyped_error",
                                             error=p.stderr[-2000:])]  # fmt: skip
            break
        order = resolve_inputs(inp, extensions_of(resolve_preset("quickstart")), exclude=out_dir)
        culprit = next((it.source for it in order.items if by_rel[it.source]["id"] not in recs),
                       None)  # fmt: skip
        if culprit is None:
            break
        rec(by_rel[culprit], how, f"the extract run died on it ({err})")
        os.unlink(os.path.join(inp, culprit))
    return list(recs.values())


# --- reports ----------------------------------------------------------------------------------


def counts(records):
    """{(family, backend): Counter(outcome)}"""
    out: dict = {}
    for r in records:
        out.setdefault((r["family"], r["backend"]), Counter())[r["outcome"]] += 1
    return out


def table(records) -> str:
    c = counts(records)
    outcomes = [o for o in OK + FAILING if any(o in v for v in c.values())]
    outcomes += sorted({o for v in c.values() for o in v} - set(outcomes))
    head = f"{'family':12s} {'backend':18s} " + " ".join(f"{o[:16]:>16s}" for o in outcomes)
    lines = [head, "-" * len(head)]
    for (fam, be) in sorted(c):
        v = c[(fam, be)]
        lines.append(f"{fam:12s} {be:18s} " + " ".join(f"{v.get(o, 0):16d}" for o in outcomes))
    tot = Counter()
    for v in c.values():
        tot.update(v)
    lines.append(f"{'total':12s} {'':18s} " + " ".join(f"{tot.get(o, 0):16d}" for o in outcomes))
    return "\n".join(lines)


def failures(records):
    return [r for r in records if r["outcome"] in FAILING]
