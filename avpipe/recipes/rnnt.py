"""RNN-T / CTC speech training feed: a NeMo manifest -> padded log-mel batches.

::

    feed = avpipe.recipes.rnnt_feed("train.jsonl", max_duration=400, seed=0,
                                    rank=rank, world_size=world)
    for batch in feed:                  # one epoch
        batch.features                  # [B, n_mels, T] float32 (numpy / cupy / torch)
        batch.feature_lengths           # [B] int64
        batch.transcripts, batch.paths  # list[str]

Decoding: the feed's groups through
:meth:`avpipe.pipeline.audio_loader.AudioBatchLoader.decode_groups` where it applies (files
without offsets, of one sample rate; resampled to ``sample_rate`` after): on a GPU with FLAC
sources its GPU FLAC decoder (frames decoded on the GPU, bit-exact to libFLAC, whole windows of
files read ahead); on the CPU with ``decoder="processes"`` its worker processes (libsndfile
into a shared ring). Otherwise ``avpipe.load_audio`` (offset / duration honoured, resampled to
``sample_rate``) in a thread pool, which also decodes the replacements of failed items. (The
worker processes decode faster than the threads, but a whole CPU feed, log-mel included, is
no faster with them (docs/how-it-works.md, "Measured trade-offs"): "auto" keeps the threads on
the CPU.) Features: ``avpipe.ops.audio.log_mel`` with the ``preset``. A decoded item holding
NaN / infinite samples, or samples beyond :data:`MAX_SAMPLE` in magnitude (damaged float data),
fails as :class:`~avpipe.CorruptDataError` (skipped and reported with ``on_error="skip"``).

``training=True`` augments, in this order (``training=False``: none of it):

1. speed perturbation (:mod:`avpipe.ops.audio_augment`: ``sample_speed_params`` /
   ``apply_speed_perturb``): ``speed_perturb=(0.85, 1.15)`` (default) draws each item's factor
   from U(low, high) on a grid of ``0.01``, a list draws one of its factors, None turns it off;
   items of one factor are resampled together (a loop over the distinct factors, none per item);
2. the ``signal_augment`` hooks;
3. log-mel with the preset's dither (``log_mel(training=True)``, seeded by one
   :mod:`avpipe.ops.random` word of ``(seed, "dither", epoch)`` per item id, combined over the
   batch's ids: a resumed run dithers identically on the same device);
4. SpecAugment (``audio_augment.spec_augment``; ``spec_augment=dict(freq_masks=2,
   freq_width=27, time_masks=10, time_width=0.05)`` by default, None turns it off);
5. the ``feature_augment`` hooks.

Every draw of 1 and 4 is keyed by ``(seed, stream, epoch, item id)``: a resumed feed and the CPU
and GPU paths draw the same factors and masks.

Augmentation hooks: ``signal_augment`` (before the features) and ``feature_augment`` (after),
lists of callables ``f(arrays: dict, seed, epoch, ids) -> dict``; ``arrays`` holds
``signals [B, n]`` + ``lengths [B]`` (host int64), resp. ``features`` + ``feature_lengths``; draw
randomness with :mod:`avpipe.ops.random` keyed by ``(seed, epoch, ids)`` and a resume stays
exact.
"""

from __future__ import annotations

import warnings

import numpy as np

from .._source import TimedFile, is_regular_file, open_source
from ..decoding.audio import DAMAGE_POLICIES, load_audio, shorter_than_declared
from ..device import array_module, resolve_device
from ..errors import CorruptDataError, naming
from ..formats import is_flac
from ..ops import audio_augment as _aug
from ..ops import random as _rnd
from ..ops.audio import log_mel, log_mel_frame_lengths, resample, resolve_preset
from ..pipeline.audio_loader import AudioBatchLoader
from ..pipeline.feed import Feed, Task
from ..pipeline.sharded import (
    Listing,
    is_mix_spec,
    mix_listing,
    shard_groups,
    sharded_listing,
)
from ..pipeline.sources import read_manifest, within_max_duration
from ..pipeline.workers import WorkerLost

__all__ = ["rnnt_feed", "RnntTask", "SPEC_AUGMENT", "MAX_SAMPLE"]

SPEC_AUGMENT = dict(freq_masks=2, freq_width=27, time_masks=10, time_width=0.05)

# A decoded sample beyond this magnitude is damage, not audio: PCM decodes to [-1, 1] and float
# files written unscaled stay within the integer ranges (2**31), while a flipped exponent bit in
# a float WAV gives 1e37 - finite, but its float32 power spectrum overflows and the item's
# features (per-feature normalization) come out NaN. Below it the features stay finite.
MAX_SAMPLE = 2.0 ** 32


def rnnt_feed(manifest, *, batch_size=None, max_duration=None, seed=0, shuffle=True, rank=0,
              world_size=1, training=True, preset="nemo", sample_rate=16000, device=None,
              framework=None, on_error="skip", prefetch=2, deadline="auto", threads=8,
              decoder="auto", signal_augment=(), feature_augment=(), bucket_window=100,
              speed_perturb=(0.85, 1.15), spec_augment=SPEC_AUGMENT, root=None,
              on_damage="error", tarred_audio_filepaths=None, storage_options=None,
              shard_order=False):
    """A :class:`~avpipe.pipeline.feed.Feed` of log-mel batches from a NeMo manifest.

    ``batch_size`` items per batch, or ``max_duration`` seconds of padded audio per batch
    (duration buckets; items longer than ``max_duration`` are left out and listed in
    ``feed.errors``). ``max_duration`` is in manifest seconds (the ``duration`` fields), checked
    before speed perturbation: with ``training=True`` a factor ``f`` makes an item
    ``duration / f`` long, so a batch's padded audio can reach ``max_duration / low`` for
    ``speed_perturb=(low, high)`` (the smallest factor of a list), about 1.18x
    ``max_duration`` at the default 0.85 (give ``max_duration * low`` if memory must hold the
    bound after augmentation). Batch fields: ``features [B, n_mels, T]`` float32, ``feature_lengths
    [B]``, ``transcripts``, ``paths`` (absolute), ``durations`` (manifest seconds), ``ids``.
    ``deadline``: seconds one item may take to read and decode (``"auto"``: the
    ``AVPIPE_FEED_DEADLINE`` setting, 60 s unless set; None or 0: no limit); an item past it
    is skipped as a :class:`~avpipe.DecodeTimeoutError` naming the file, and the thread stuck
    in it is given up (never waited for: not by the next epoch, ``close``, nor at exit).
    ``decoder``: "gpu"
    (GPU FLAC windows; FLAC files of one sample rate, no offsets), "processes" (the loader's
    worker processes: CPU device, fixed ``batch_size``, files of one sample rate without
    offsets), "threads" (``load_audio`` in threads; "cpu" is the same) or "auto" ("gpu" when
    that applies and ``device`` is a GPU, else "threads"). ``speed_perturb``,
    ``spec_augment``: the training augmentation (module docstring). ``root``: a folder every
    listed file must lie under (``..`` and links resolved); a manifest line that breaks the
    manifest rule (:mod:`avpipe.pipeline.sources`) or lists a file outside ``root`` raises
    :class:`~avpipe.errors.ManifestError` / :class:`~avpipe.errors.OutsideRootError` naming the
    file and the line, here, before anything runs.

    Damage: an item whose file holds fewer samples than its header declares (cut short, an Ogg
    page lost, a FLAC STREAMINFO count its frames contradict), or that decodes more than
    :data:`~avpipe.decoding.audio.DURATION_TOLERANCE_S` (0.1 s) shorter than its manifest
    ``duration``, fails as :class:`~avpipe.CorruptDataError` with ``on_damage="error"`` (the
    default): skipped and listed in ``feed.errors`` with the reason (``on_error="skip"``), never
    trained with its full transcript. ``on_damage="warn"`` trains it as decoded, issues a
    ``RuntimeWarning`` naming the file and lists it in ``feed.task.damaged`` (``{path: why}``).
    Reads are bounded by the item: ``offset`` + ``duration`` of the file (speed perturbation
    resamples that span and needs nothing past it), never the whole of a longer file.

    Sharded sources (:mod:`avpipe.pipeline.sharded`): ``manifest`` may also be WebDataset tar
    shards (a path or URL with brace ranges, or a list: ``KEY.flac|wav|ogg`` + ``KEY.json``
    with ``text`` and ``duration``) or a lhotse Shar folder; with
    ``tarred_audio_filepaths=PATTERN`` it is a NeMo tarred-audio manifest (``shard_id`` per
    line). Their items' ``paths`` are ``URL#KEY``; each is read by one ranged read of its
    member (never a whole shard); damage found while indexing the shards is in ``feed.errors``
    from the start. ``storage_options``: passed to fsspec for URLs (``s3://``, ``gs://``,
    ``http(s)://``). Several sources mixed by weight (NeMo's ``input_cfg``, lhotse's ``mux``):
    ``manifest=[{"source": ..., "weight": 2.0}, {"manifest_filepath": ...,
    "tarred_audio_filepaths": ..., "weight": 1.0}]`` (:func:`avpipe.pipeline.sharded.mix_listing`:
    the mix is drawn once per ``seed``). ``shard_order=True``: the epoch's order keeps each shard's items together
    (the shards shuffled, then the items within each shard): reads go through one shard at a
    time, and a batch draws from one or two shards instead of all of them.
    """
    spec = (rnnt_feed, dict(
        manifest=manifest, batch_size=batch_size, max_duration=max_duration, seed=seed,
        shuffle=shuffle, rank=rank, world_size=world_size, training=training, preset=preset,
        sample_rate=sample_rate, device=device, framework=framework, on_error=on_error,
        prefetch=prefetch, deadline=deadline, threads=threads, decoder=decoder,
        signal_augment=signal_augment, feature_augment=feature_augment,
        bucket_window=bucket_window, speed_perturb=speed_perturb,
        spec_augment=spec_augment, root=root, on_damage=on_damage,
        tarred_audio_filepaths=tarred_audio_filepaths,
        storage_options=storage_options, shard_order=shard_order))  # fmt: skip
    def read(src, tarred):
        got = sharded_listing(src, kind="audio", storage_options=storage_options,
                              tarred_audio_filepaths=tarred)
        return got if got is not None else Listing(read_manifest(src, root=root), [])

    if is_mix_spec(manifest):
        listing = mix_listing(manifest, read=read, seed=seed)
    else:
        listing = read(manifest, tarred_audio_filepaths)
    items, errors = listing.items, list(listing.errors)
    items, left_out = within_max_duration(items, max_duration)
    errors += left_out
    durations = [it.duration or 0.0 for it in items]
    dev = resolve_device(device)
    task = RnntTask(preset=preset, training=training, sample_rate=sample_rate, seed=seed,
                    device=dev, deadline=deadline, threads=threads, decoder=decoder,
                    signal_augment=signal_augment, feature_augment=feature_augment,
                    speed_perturb=speed_perturb, spec_augment=spec_augment,
                    batch_size=batch_size, on_damage=on_damage)
    return Feed(items, task, batch_size=batch_size, max_duration=max_duration,
                durations=durations, seed=seed, shuffle=shuffle, rank=rank,
                world_size=world_size, prefetch=prefetch, on_error=on_error, device=dev,
                framework=framework, bucket_window=bucket_window, initial_errors=errors,
                spec=spec, groups=shard_groups(items) if shard_order else None,
                pad="repeat" if training else "empty")


class RnntTask(Task):
    array_fields = ("features", "feature_lengths")

    def __init__(self, *, preset, training, sample_rate, seed, device, deadline="auto", threads=8,
                 decoder="auto", signal_augment=(), feature_augment=(),
                 speed_perturb=None, spec_augment=None, batch_size=None, on_damage="error"):
        super().__init__()
        if on_damage not in DAMAGE_POLICIES:
            raise ValueError(f"on_damage must be 'error' or 'warn', got {on_damage!r}")
        self.on_damage = on_damage
        self.damaged: dict = {}  # path -> why, items trained though damaged (on_damage="warn")
        if decoder not in ("auto", "cpu", "threads", "gpu", "processes"):
            raise ValueError("decoder must be 'auto', 'gpu', 'processes' or 'threads' ('cpu'), "
                             f"got {decoder!r}")
        decoder = "threads" if decoder == "cpu" else decoder
        if decoder == "gpu" and not device.is_cuda:
            raise ValueError(f"decoder='gpu' needs a GPU device, got {device}")
        if decoder == "processes" and (device.is_cuda or batch_size is None):
            raise ValueError("decoder='processes' needs device='cpu' and a fixed batch_size")
        self.batch_size = None if batch_size is None else int(batch_size)
        self.preset, self.training = preset, bool(training)
        self.sample_rate, self.seed, self.device = int(sample_rate), int(seed), device
        self.deadline, self.threads = deadline, int(threads)
        self.decoder = decoder
        self.signal_augment = list(signal_augment)
        self.feature_augment = list(feature_augment)
        self.speed = _speed_args(speed_perturb)
        if spec_augment is not None:
            spec_augment = {**SPEC_AUGMENT, **dict(spec_augment)}
        self.spec_augment = spec_augment
        self._loader = None
        self._loader_tried = False

    # -- decoding ----------------------------------------------------------------------------
    def decode_one(self, i, item):
        if item.locator is not None:  # a shard's member: its bytes by one ranged read
            return self._samples(item, self._decode_member(item))
        if not is_regular_file(item.path):  # missing, or a pipe or device (reading could block)
            open_source(item.path)  # raises FileNotFoundError / UnsupportedFormatError naming it
        # the decoder reads the parts of the file the item's span needs (the "read" stage of
        # stats(): the time in those reads), never the whole of a longer file
        f = TimedFile(item.path)
        # its first byte is read here, outside the decoder: a read that never returns then blocks
        # this thread alone (soundfile opens every file under one process-wide lock: a stuck
        # open there would stop every item's decode)
        f.read(1)
        f.seek(0)
        try:
            a = load_audio(f, sample_rate=self.sample_rate, offset=item.offset,
                           duration=item.duration if item.duration else None,
                           on_damage=self.on_damage)
        finally:
            f.close()
            if self.timings is not None:
                self.timings("read", f.seconds)
        return self._samples(item, a)

    def _decode_member(self, item):
        """``load_audio`` of a shard member's bytes, its errors naming the item."""
        import time

        t0 = time.perf_counter()
        data = item.media()
        if self.timings is not None:
            self.timings("read", time.perf_counter() - t0)
        with naming(item.path, data):
            return load_audio(data, sample_rate=self.sample_rate, offset=item.offset,
                              duration=item.duration if item.duration else None,
                              on_damage=self.on_damage)

    def _samples(self, item, a):
        """A decoded item's samples, after the damage and signal checks."""
        self._check_damage(item, a.damaged or shorter_than_declared(
            a.num_samples, a.sample_rate, item.duration))
        x = a.samples
        bad = _signal_problem(float(np.abs(x).max()) if x.size else 0.0)
        if bad is not None:
            raise CorruptDataError(item.path, bad)
        return x

    def _check_damage(self, item, why):
        """An item decoded though damaged (``why``): CorruptDataError (``on_damage="error"``),
        else a warning and an entry of ``damaged``."""
        if not why:
            return
        if self.on_damage == "error":
            raise CorruptDataError(item.path, why)
        if item.path not in self.damaged:
            self.damaged[item.path] = why
            warnings.warn(f"{item.path}: {why} (trained as decoded: on_damage='warn')",
                          RuntimeWarning, stacklevel=2)

    def _loader_kind(self, items):
        """"gpu", "processes" or None (threads) for these items."""
        plain = all(not it.offset and it.locator is None for it in items)
        if self.device.is_cuda:
            if self.decoder in ("threads",):
                return None
            ok = plain and all(is_flac(it.path) for it in items)
            if self.decoder == "gpu" and not ok:
                raise ValueError("decoder='gpu' takes FLAC files without offsets only")
            return "gpu" if ok else None
        if self.decoder != "processes":  # processes are no faster end to end on the CPU
            return None
        import multiprocessing as mp

        # not inside a daemonic process (a DataLoader worker): it may not start workers
        ok = plain and self.batch_size is not None and not mp.current_process().daemon
        if self.decoder == "processes" and not ok:
            raise ValueError("decoder='processes' takes files without offsets only, outside "
                             "daemonic processes")
        return "processes" if ok else None

    def decode_groups(self, groups):
        if not self._loader_tried:
            self._loader_tried = True
            kind = self._loader_kind(self.feed_items)
            if kind is not None:
                self._loader = self._make_loader(kind)
        if self._loader is None:
            yield from super().decode_groups(groups)
            return
        yield from self._loader_groups(groups)

    def _make_loader(self, kind):
        # the batch loader over every path of the feed (known up front: sizes and lengths come
        # from the headers once)
        paths = sorted({it.path for it in self.feed_items})
        # the seconds each file's items need from its start (None: the whole file)
        need: dict = {}
        for it in self.feed_items:
            sec = float(it.duration) if it.duration else None
            old = need.get(it.path, 0.0)
            need[it.path] = None if sec is None or old is None else max(old, sec)
        try:
            if kind == "gpu":
                ld = AudioBatchLoader(paths, batch_size=64, on_damage=self.on_damage,
                                      device=f"cuda:{self.device.index}", decoder="gpu")
            else:
                import os

                # a batch's workers answer within the feed's deadline (then its items fail
                # as timeouts and the workers are replaced)
                ld = AudioBatchLoader(paths, batch_size=self.batch_size, device="cpu",
                                      decoder="cpu", transport="float32",
                                      num_workers=min(self.threads, os.cpu_count() or 1),
                                      on_damage=self.on_damage,
                                      read_seconds=[need[p] for p in paths],
                                      **({"timeout": self.deadline} if self.deadline else {}))
        except ValueError:
            if self.decoder in ("gpu", "processes"):
                raise
            return None  # several sample rates: the threads' path resamples
        except WorkerLost as e:
            # its pass over the files' headers got no answer in time (a read that never
            # returns): the threads decode the feed, each item within the deadline
            warnings.warn(f"the audio loader could not read the files' headers ({e}); "
                          "decoding with threads instead", RuntimeWarning, stacklevel=2)
            return None
        if kind == "gpu" and self.decoder == "auto" and ld.sample_rate:
            # the GPU decodes whole files: one much longer than its items need (a long
            # recording cut by the manifest) goes to the threads, which read just the span
            for p, n in zip(paths, ld.frames):
                sec = need[p]
                if sec is not None and n > (2 * sec + 1.0) * ld.sample_rate:
                    ld.close()
                    return None
        self._row = {p: k for k, p in enumerate(paths)}
        return ld

    def _loader_groups(self, groups):
        import time

        ld = self._loader
        gpu = ld.decoder == "gpu"
        src_sr = int(ld.sample_rate or self.sample_rate)
        pending = []

        def indices():
            for g in groups:
                pending.append(g)
                yield [self._row[it.path] for _, it in g]

        t_last = time.perf_counter()
        # runs on the producer thread, inside the feed's device and producer stream
        for batch in ld.decode_groups(indices()):
            g = pending.pop(0)
            x, lens, errs = batch.signals, batch.lengths, dict(batch.errors)
            # the rows' peaks, one reduction and one copy per batch (the loaders check neither
            # NaN nor magnitude). Not for the GPU FLAC loader: FLAC holds integer PCM, decoded
            # to [-1, 1] (the check's copy would make the producer wait for the GPU's work on
            # the previous batch, every batch)
            peaks = None if gpu else _peaks(x, lens)
            out = []
            for r, (_, it) in enumerate(g):
                if r in errs:
                    out.append(errs[r])
                    continue
                bad = None if peaks is None else _signal_problem(float(peaks[r]))
                if bad is not None:
                    out.append(CorruptDataError(it.path, bad))
                    continue
                try:
                    self._check_damage(it, ld.damaged.get(it.path) or shorter_than_declared(
                        int(lens[r]), src_sr, it.duration))
                except CorruptDataError as e:
                    out.append(e)
                    continue
                n = int(lens[r])
                if it.duration:
                    n = min(n, int(round(it.duration * src_sr)))
                if src_sr != self.sample_rate:
                    out.append(resample(x[r, :n], src_sr, self.sample_rate))
                elif gpu:  # a reference, sliced only if collate cannot take the batch whole
                    out.append(LoaderRow(x, r, n))
                else:
                    out.append(x[r, :n])
            now = time.perf_counter()
            if self.timings is not None:
                self.timings("decode", now - t_last)
            t_last = now
            # GPU rows: ready in order on the producer's stream, where collate reads them
            yield out

    # -- batch -----------------------------------------------------------------------------
    def collate(self, values, pairs, epoch, step):
        ids = np.array([i for i, _ in pairs], np.int64)
        items = [it for _, it in pairs]
        xp = self.device.xp
        lens = np.array([int(v.shape[0]) for v in values], np.int64)
        n = int(lens.max()) if len(lens) else 0
        whole = None if self.signal_augment else _rows_of_one_batch(values)
        if whole is None:
            values = [v.array() if isinstance(v, LoaderRow) else v for v in values]
        if whole is not None:  # the loader's padded batch itself: no copy per row
            x = whole[:, :n]
        elif any(not isinstance(v, np.ndarray) for v in values):  # GPU rows (+ host refills)
            x = xp.zeros((len(values), n), xp.float32)
            for r, v in enumerate(values):
                x[r, : v.shape[0]] = xp.asarray(v)
        else:
            host = np.zeros((len(values), n), np.float32)
            for r, v in enumerate(values):
                host[r, : v.shape[0]] = v
            x = xp.asarray(host)
        draws = self._draws()
        if not draws:
            return self._augment_and_features(x, lens, ids, items, epoch)
        with _rnd.drawn_together(self.seed, epoch, ids, draws):
            return self._augment_and_features(x, lens, ids, items, epoch)

    def _draws(self):
        """The ``(stream, words)`` the samplers of one training batch draw (one Philox pass
        for all of them: ``ops.random.drawn_together``)."""
        if not self.training:
            return []
        out = [("dither", 1)]
        if self.speed is not None:
            out.append(("speed_perturb", 1))
        if self.spec_augment is not None and not self.device.is_cuda:  # (a GPU draws its own)
            sa = self.spec_augment
            out += [("spec_augment.freq", 2 * int(sa["freq_masks"])),
                    ("spec_augment.time", 2 * int(sa["time_masks"]))]
        return out

    def _augment_and_features(self, x, lens, ids, items, epoch):
        xp = self.device.xp
        if self.training and self.speed is not None and len(lens):
            p = _aug.sample_speed_params(self.seed, epoch, ids, **self.speed)
            x, lens = _aug.apply_speed_perturb(x, lens, p, sample_rate=self.sample_rate,
                                               quality="fast")
        arrays = {"signals": x, "lengths": lens}
        for f in self.signal_augment:
            arrays = f(arrays, self.seed, epoch, ids)
        x, lens = arrays["signals"], np.asarray(arrays["lengths"], np.int64)
        if len(lens):
            feats, fl = log_mel(x, lens, preset=self.preset, training=self.training,
                                seed=_dither_seed(self.seed, epoch, ids))
            if self.training and self.spec_augment is not None:
                # the frame lengths from the host lengths (log_mel's rule): no wait on the
                # device for its copy of them
                fl_host = log_mel_frame_lengths(lens, preset=self.preset,
                                                frames=feats.shape[-1])
                # in place (log_mel's own array): on a GPU one launch draws the masks and
                # writes the masked cells alone
                feats = _aug.spec_augment(feats, fl_host, seed=self.seed, epoch=epoch, ids=ids,
                                          inplace=True, **self.spec_augment)
        else:
            # an empty batch (every item skipped) keeps the mel axis: [0, n_mels, 0]
            feats = xp.zeros((0, int(resolve_preset(self.preset).n_mels), 0), xp.float32)
            fl = xp.zeros(0, xp.int64)
        arrays = {"features": feats, "feature_lengths": fl}
        for f in self.feature_augment:
            arrays = f(arrays, self.seed, epoch, ids)
        return {
            "features": arrays["features"],
            "feature_lengths": arrays["feature_lengths"],
            "transcripts": [it.text or "" for it in items],
            "paths": [it.path for it in items],
            "durations": [it.duration for it in items],
        }

    def close(self):
        super().close()
        if self._loader is not None:
            self._loader.close()
            self._loader = None
        self._loader_tried = False



class LoaderRow:
    """Row ``row`` of a GPU loader batch ``batch`` (its first ``n`` samples), not sliced yet:
    a batch's values are usually that batch's rows in order, which :func:`_rows_of_one_batch`
    tells from these three fields, where 64 cupy views and their checks cost the producer
    about a millisecond a batch. ``array()`` is the view, for any other list of values."""

    __slots__ = ("batch", "row", "n")

    def __init__(self, batch, row: int, n: int):
        self.batch, self.row, self.n = batch, int(row), int(n)

    @property
    def shape(self) -> tuple:
        return (self.n,)

    def array(self):
        return self.batch[self.row, : self.n]


def _rows_of_one_batch(values):
    """The ``[B, m]`` device batch whose rows ``0 .. B-1`` are the values, in order (a batch
    the loader decoded, every item kept: :class:`LoaderRow` references), or None. What lies
    past a value's length in its row is never read: every step after takes the lengths."""
    if not values or type(values[0]) is not LoaderRow:
        return None
    base = values[0].batch
    if getattr(base, "ndim", 0) != 2 or base.shape[0] != len(values):
        return None
    for r, v in enumerate(values):
        if type(v) is not LoaderRow or v.batch is not base or v.row != r:
            return None
    return base


def _peaks(x, lengths):
    """Per row of ``x [B, n]`` (numpy or cupy) the largest magnitude of its first
    ``lengths[r]`` samples, on the host (a row holding NaN: NaN); one reduction."""
    if x is None or x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        return np.zeros(len(lengths), np.float64)
    xp = array_module(x)
    valid = xp.arange(x.shape[1])[None, :] < xp.asarray(np.asarray(lengths, np.int64))[:, None]
    m = xp.where(valid, xp.abs(x), 0).max(axis=1)
    return np.asarray(m.get() if hasattr(m, "get") else m, np.float64)


def _signal_problem(peak):
    """Why a decoded signal of this peak magnitude cannot be an item (None: it can)."""
    if not np.isfinite(peak):
        return "the audio holds NaN or infinite samples"
    if peak > MAX_SAMPLE:
        return (f"a sample of magnitude {peak:.3g}, beyond {MAX_SAMPLE:.3g}: damaged data, not "
                "audio (its features would overflow)")
    return None


def _speed_args(speed):
    """``speed_perturb`` -> ``sample_speed_params`` keywords (None: off). A 2-tuple ``(low,
    high)``: a range; a list (or any other sequence): the factors."""
    if speed is None:
        return None
    if isinstance(speed, tuple) and len(speed) == 2:
        lo, hi = float(speed[0]), float(speed[1])
        if not 0 < lo <= hi:
            raise ValueError(f"speed_perturb range must be 0 < low <= high, got {speed!r}")
        return {"factor_range": (lo, hi), "step": 0.01}
    fs = [float(f) for f in speed]
    if not fs or min(fs) <= 0:
        raise ValueError(f"speed_perturb factors must be positive, got {speed!r}")
    return {"factors": fs}


def _dither_seed(seed, epoch, ids):
    """log_mel's dither seed for a batch: one ops.random word per item id, combined (the
    same batch in a resumed run gets the same seed)."""
    w = _rnd.words(seed, "dither", epoch, np.asarray(ids, np.int64), 1)[:, 0]
    return int(np.bitwise_xor.reduce(w.astype(np.uint32))) if len(w) else 0
