"""The producer thread that makes a feed's batches ahead, and the consumer's iterator.

Errors (``on_error="skip"``): an item that fails (decode error, missing file, past the
``deadline``) is reported in the batch's ``errors`` and in ``feed.errors`` as ``(path,
message)`` (``feed.errors`` lists each pair once per feed: a file that fails every epoch, or
every view of a bad video, is listed once), and replaced by the *last not yet used item of the
same rank's epoch*, not by the next one:
the rank's items are its batches in order, and replacements are taken from the end of that
sequence backwards (its last item, then the one before, ...), never from the failing batch
itself or an earlier one, and go at the end of the batch; a replacement that fails is reported
and replaced the same way. So ranks stay disjoint, no good item is lost, batches stay full, and
only the rank's last batch(es) of the epoch run out of unused items. With ``max_duration`` the
same rule applies while the replacement fits the batch's budget (``count * longest <=
max_duration``); the first one that does not fit ends the refill. Then:

* training feeds (``pad="repeat"``: ``training=True`` / ``train=True``) fill the batch to its
  planned size with *repeats*: items of the rank's epoch already handed out (its earlier
  batches' items in order, then the replacements it borrowed), then, for a rank without enough
  good items of its own, the epoch's other items in plan order; a candidate already in the
  batch, failed before in this run, or (``max_duration``) not fitting the budget is passed over.
  A training batch is therefore never empty (unless no item of the epoch decodes at all) and
  ``len(feed)`` stays the same on every rank. The repeats depend only on the position, so a
  resume repeats the same items (as ``DistributedSampler`` pads with the epoch's first items).
* evaluation feeds (``pad="empty"``) never repeat: every item is in exactly one batch on one
  rank or in the errors, and the rank's last batches come out short, or empty where fewer good
  items are left than batches (``len(feed)`` is fixed before anything is decoded, the same on
  every rank; rank padding, below, can give empty batches as well). An empty batch is
  well-formed: every array field with 0 rows and its other axes (the recipes' shapes).

Execution: a background thread decodes and collates batches ahead into a queue of ``prefetch``
batches; while the queue is full it holds one more, so at most ``prefetch + 1`` collated
batches are ahead of the consumer (decoding reads further ahead by :meth:`Task.decode_groups`'
rule). Dropping (or ``close()``-ing) the iterator mid-epoch stops and joins it. On a GPU the
producer works on its own CUDA stream and records an event after each batch; the consumer's
current stream (cupy's, or torch's with ``framework="torch"``) waits on it, so batches arrive
ordered on the consumer's stream without a host sync. When the consumer asks for the next
batch, the previous batch's arrays go back to the producer with an event recorded on the
consumer's stream; the producer's stream waits on it before they are dropped, so their memory
(from the producer stream's pool) is reused only after the consumer's work on them. A batch the
consumer keeps past the next ``next()`` and uses later: synchronize before dropping it.

Between epochs the producer does not stop: past an epoch's last batch it goes on with the next
epoch's first batches (the same bound: ``prefetch + 1``), and the next ``iter(feed)`` takes
them over when it starts where they start (the next epoch from its beginning, as after a full
epoch or ``set_epoch`` of that epoch), so an epoch starts without waiting for its first batches
to decode. Any other start (``set_epoch`` of another epoch, ``load_state_dict``) drops them; so
does ``feed.close()``, and the producer drops them itself when no ``iter`` takes them within
:data:`AHEAD_IDLE_S` seconds (a feed that is not iterated again holds no thread or memory).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import queue
import threading
import time
import weakref

import numpy as np

from ...device import export
from .order import start_of
from .task import LIVE, Batch, stopping

__all__ = ["EpochIterator", "Producer", "discard_ahead", "stop_producers", "STAGES",
           "AHEAD_IDLE_S", "EXIT_WAIT_S"]

# the stages feed.stats() reports
STAGES = ("read", "decode", "gpu", "wait", "step")

# seconds the next epoch's first batches, decoded ahead, wait for an ``iter`` to take them
AHEAD_IDLE_S = 10.0


class Producer:
    """What a producer thread and its consumer share (one per producer thread, kept across the
    epochs it runs ahead into)."""

    def __init__(self):
        self.stop = threading.Event()
        # batches handed over, each with an event recorded on the consumer's stream when the
        # next batch was asked for: the producer's stream waits on it before dropping them
        self.retire = collections.deque()
        self.lock = threading.Lock()
        # (its start position, monotonic time) while the next epoch waits to be taken over
        self.next_epoch = None
        self.q = None
        self.thread = None
        self.feed_collected = None  # finalizer of the feed while waiting (stop_with)

    def hold_next_epoch(self, pos):
        """The consumer finished an epoch: the producer's next epoch (from ``pos``) waits for
        an ``iter`` to take it over. False if the producer has stopped."""
        with self.lock:
            if self.stop.is_set() or self.thread is None or not self.thread.is_alive():
                return False
            self.next_epoch = (dict(pos), time.monotonic())
            return True

    def stop_with(self, feed):
        """Stop the waiting producer when ``feed`` is collected."""
        self.feed_collected = weakref.finalize(feed, self.stop.set)

    def take_over(self, pos) -> bool:
        """Take the waiting producer over for an epoch starting at ``pos`` (False: it does not
        start there, or it has stopped)."""
        with self.lock:
            if self.next_epoch is None or self.next_epoch[0] != pos or self.stop.is_set() \
                    or not self.thread.is_alive():
                return False
            self.next_epoch = None
            if self.feed_collected is not None:
                self.feed_collected.detach()
                self.feed_collected = None
            return True

    def expired(self) -> bool:
        """Producer side: waiting for longer than AHEAD_IDLE_S (then it stops itself)."""
        with self.lock:
            if self.next_epoch is not None and time.monotonic() - self.next_epoch[1] > AHEAD_IDLE_S:
                self.stop.set()
            return self.stop.is_set()

    def drop(self):
        _stop(self, self.q, self.thread)


def _stream_of(feed):
    """The feed's producer stream (one per feed: its memory pool arena is reused)."""
    dev = feed.device
    if not dev.is_cuda:
        return None
    if feed._stream is None:
        import cupy

        with cupy.cuda.Device(dev.index):
            feed._stream = cupy.cuda.Stream(non_blocking=True)
    return feed._stream


@contextlib.contextmanager
def _on(dev, stream):
    """The producer's device and stream for the block (nothing on the CPU)."""
    if stream is None:
        yield
        return
    import cupy

    with cupy.cuda.Device(dev.index), stream:
        yield


def _retire(shared, stream):
    """Drop the batches the consumer is done with, after the producer stream waits on the
    consumer's event: memory they free is reused only by work ordered after the consumer's."""
    while shared.retire:
        try:
            held, ev = shared.retire.popleft()
        except IndexError:
            break
        if stream is not None and ev is not None:
            stream.wait_event(ev)
        del held


def discard_ahead(feed, producer):
    """Stop a producer waiting with the next epoch's batches; the batches the consumer had are
    dropped after the producer stream waits on the consumer's events (as the producer would
    have)."""
    producer.drop()
    stream = _stream_of(feed)
    with _on(feed.device, stream):
        _retire(producer, stream)


def _produce(feed, pos, q, shared):
    """Producer: decode, handle errors, collate; put ("batch", batch, pos_after, event,
    gpu_timing), ("end", pos) or ("error", exc) into ``q`` (bounded: blocks when full). Past an
    epoch's end it goes on with the next epoch (the module docstring: between epochs)."""
    def put(msg):
        while not shared.expired():
            try:
                q.put(msg, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    while True:
        gen = _batches(feed, pos, shared)
        ended = None
        try:
            for msg in gen:
                if not put(msg):
                    return
                if msg[0] == "end":
                    ended = msg[1]
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(("error", e))
            return
        finally:
            gen.close()
        if ended is None or shared.stop.is_set():
            return
        pos = start_of(ended["epoch"] + 1)


def _batches(feed, pos, shared):
    """The epoch's batches for this rank from ``pos`` (generator; runs on the producer)."""
    epoch, rebase = pos["epoch"], pos["rebase"]
    plan = feed._plan(epoch, rebase)
    share = feed.rank_batches(plan)
    steps = len(share)
    flat = np.concatenate(share) if share else np.zeros(0, np.int64)
    starts = np.cumsum([0] + [len(b) for b in share])
    state = {"borrowed": pos["borrowed"]}
    refill = feed.on_error == "skip"
    durs = feed.durations if feed.mode == "duration" else None
    items = feed.items
    task = feed.task
    dev = feed.device
    stream = _stream_of(feed)
    task.epoch = epoch  # decode_one's random draws are keyed by it
    known_bad = set()  # items that failed in this run of the epoch (not tried again as repeats)

    def live(s):
        """Step s's items not yet taken as replacements, in order. Replacements come from the
        end of the share, so the live items of a step are always a prefix of its items."""
        end = min(int(starts[s + 1]), len(flat) - state["borrowed"])
        return [int(i) for i in flat[int(starts[s]) : max(end, int(starts[s]))]]

    def groups():
        for s in range(pos["step"], steps):
            yield [(i, items[i]) for i in live(s)]

    decoded = task.decode_groups(groups())
    try:
        for s in range(pos["step"], steps):
            if shared.stop.is_set():
                return
            # GPU decoders' work goes on the producer stream
            with _on(dev, stream), stopping(shared.stop):
                group_vals = next(decoded)
            # the group was pulled before later replacements were taken: keep its live prefix
            planned = live(s)
            good_ids, good_vals = [], []
            failed = []  # (path, message): reported when the consumer takes this batch
            for i, v in zip(planned, group_vals):
                if isinstance(v, BaseException):
                    known_bad.add(i)
                    _fail(feed, i, v, failed)
                else:
                    good_ids.append(i)
                    good_vals.append(v)
            want = len(planned)
            last_of_batch = int(starts[s + 1]) - 1
            while refill and len(good_ids) < want:
                # replacements: this rank's last unused items, taken from the end one by one
                cand = []
                while len(cand) < want - len(good_ids):
                    j = len(flat) - state["borrowed"] - 1
                    if j <= last_of_batch:
                        break
                    if durs is not None:  # max_duration: only a replacement that fits
                        now = good_ids + [c for c, _ in cand] + [int(flat[j])]
                        if len(now) * float(durs[now].max()) > feed.max_duration:
                            break
                    state["borrowed"] += 1
                    cand.append((int(flat[j]), items[int(flat[j])]))
                if not cand:
                    break
                with _on(dev, stream), stopping(shared.stop):
                    for i, v in _decode_good(feed, cand, known_bad, failed):
                        good_ids.append(i)
                        good_vals.append(v)
            full = int(starts[s + 1] - starts[s])  # the batch's size in the plan
            if refill and feed.pad == "repeat" and len(good_ids) < full:
                # training: no unused item left to replace the failed (or borrowed) ones: the
                # batch is filled with repeats of the epoch's items, never left short or empty
                for i, v in _repeat_fill(feed, plan, flat, int(starts[s]), state["borrowed"],
                                         good_ids, full, failed, known_bad, dev, stream):
                    good_ids.append(i)
                    good_vals.append(v)
            pairs = [(i, items[i]) for i in good_ids]
            if stream is not None:
                import cupy

                with cupy.cuda.Device(dev.index), stream:
                    _retire(shared, stream)
                    g0 = cupy.cuda.Event()
                    g0.record(stream)
                    fields = task.collate(good_vals, pairs, epoch, s)
                    g1 = cupy.cuda.Event()
                    g1.record(stream)
                event, gpu_timing = g1, (g0, g1)
            else:
                t1 = time.perf_counter()
                fields = task.collate(good_vals, pairs, epoch, s)
                event, gpu_timing = None, None
                feed._record("gpu", time.perf_counter() - t1)
            batch = Batch(**fields, ids=np.array(good_ids, np.int64), epoch=epoch, step=s,
                          errors=list(dict.fromkeys(failed)))
            batch._sink = feed._sink()
            after = {"epoch": epoch, "step": s + 1, "borrowed": state["borrowed"],
                     "rebase": rebase}
            yield ("batch", batch, after, event, gpu_timing, failed)
        yield ("end", {"epoch": epoch})
    finally:
        close = getattr(decoded, "close", None)
        if close is not None:
            close()


def _repeat_candidates(plan, flat, start, borrowed):
    """Training repeats for a batch of a rank's share ``flat`` that starts at ``start``: the
    rank's items of the epoch already handed out (its earlier batches' items in order, then
    the replacements it borrowed from its end), then every item of the epoch's plan in order
    (other ranks' items, for a rank with too few good items of its own)."""
    yield from flat[:start].tolist()
    if borrowed:
        yield from flat[len(flat) - borrowed:].tolist()
    for b in plan:
        yield from b.tolist()


def _repeat_fill(feed, plan, flat, start, borrowed, good_ids, want, failed, known_bad, dev,
                 stream):
    """``(id, value)`` of the repeats that fill a training batch to ``want`` items (the
    module docstring's rule). The candidates (:func:`_repeat_candidates`) depend only on the
    position (``start``, ``borrowed``), so a resumed feed repeats the same items. A candidate
    already in the batch, known to fail in this run, or (``max_duration``) not fitting the
    batch's budget is passed over; one that fails is reported and passed over."""
    durs = feed.durations if feed.mode == "duration" else None
    have = set(good_ids)
    ids = list(good_ids)
    out = []
    cands = _repeat_candidates(plan, flat, start, borrowed)
    while len(ids) < want:
        take = []
        for i in cands:
            i = int(i)
            if i in have or i in known_bad:
                continue
            if durs is not None:
                now = ids + [c for c, _ in take] + [i]
                if len(now) * float(durs[now].max()) > feed.max_duration:
                    continue
            have.add(i)
            take.append((i, feed.items[i]))
            if len(ids) + len(take) >= want:
                break
        if not take:
            break  # no good item of the epoch left to repeat (every one failed)
        with _on(dev, stream):
            for i, v in _decode_good(feed, take, known_bad, failed):
                ids.append(i)
                out.append((i, v))
    return out


def _decode_good(feed, pairs, known_bad, failed) -> list:
    """``(id, value)`` of the ``pairs`` that decode (``task.decode_items``); each one that
    fails is noted in ``known_bad`` and reported through :func:`_fail`, in order."""
    good = []
    for (i, _), v in zip(pairs, feed.task.decode_items(pairs)):
        if isinstance(v, BaseException):
            known_bad.add(i)
            _fail(feed, i, v, failed)
        else:
            good.append((i, v))
    return good


def _fail(feed, i, exc, failed):
    """Item ``i`` failed: raise (``on_error="raise"``) or note it in ``failed``, the batch's
    list, which goes into ``feed.errors`` when the consumer takes the batch (so a producer
    running ahead into the next epoch reports nothing before that epoch is iterated)."""
    it = feed.items[i]
    path = getattr(it, "path", str(it))
    if feed.on_error == "raise":
        raise exc
    failed.append((path, f"{type(exc).__name__}: {exc}"))


class EpochIterator:
    """One epoch's batches; closing (or dropping) it stops and joins the producer thread."""

    def __init__(self, feed, pos: dict, ahead: Producer | None = None):
        self._feed = feed
        self._done = False
        self._last = None
        self._pending_gpu = collections.deque()
        self._held = None  # the last batch's device arrays (see Producer.retire)
        self._sync = feed.prefetch <= 0
        if ahead is not None:  # the producer already running this epoch (taken over)
            self._shared, self._gen = ahead, None
            self._q, self._thread = ahead.q, ahead.thread
        elif self._sync:
            self._shared = Producer()
            self._gen = _batches(feed, pos, self._shared)
            self._thread = None
            self._q = None
        else:
            self._shared = Producer()
            self._gen = None
            self._q = queue.Queue(maxsize=feed.prefetch)
            # the producer holds the feed weakly: a feed dropped while its producer is waiting
            # between epochs is collected, and its finalizer stops the producer
            self._thread = threading.Thread(
                target=_produce, args=(weakref.proxy(feed), pos, self._q, self._shared),
                name="avpipe-feed-producer", daemon=True)
            self._shared.q, self._shared.thread = self._q, self._thread
            _track_producer(self._shared)
            self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._shared, self._q, self._thread)

    def __iter__(self):
        return self

    def _get(self):
        if self._sync:
            try:
                return next(self._gen)
            except BaseException as e:  # noqa: BLE001
                return ("error", e)
        while True:
            try:
                return self._q.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    return ("error", RuntimeError("the feed's producer thread ended"))

    def __next__(self):
        if self._done:
            raise StopIteration
        feed = self._feed
        t_now = time.perf_counter()
        self._consumer_event()
        msg = self._get()
        t_got = time.perf_counter()
        if msg[0] == "batch":
            feed._record("wait", t_got - t_now)
            if self._last is not None:  # the consumer's whole step: its work + this wait
                feed._record_step(t_now - self._last, t_got - t_now)
            self._last = t_got
        kind = msg[0]
        if kind == "error":
            self._finish()
            raise msg[1]
        if kind == "end":
            feed._advance(msg[1], finished=True)
            if self._thread is not None and self._shared.hold_next_epoch(feed._pos):
                # the producer goes on into the next epoch: the next iter takes it over
                self._finalizer.detach()
                self._done = True
                feed._drop_ahead()
                feed._ahead = self._shared
                self._shared.stop_with(feed)
                raise StopIteration
            self._finish()
            raise StopIteration
        _, batch, after, event, gpu_timing, failed = msg
        if failed:
            feed._record_errors(failed)
            if feed._errors_to is not None:  # a replica: its parent's too, if in this process
                parent = LIVE.get(feed._errors_to)
                if parent is not None and parent is not feed:
                    parent._record_errors(failed)
        if event is not None:
            self._held = [getattr(batch, k, None) for k in feed.task.array_fields]
            self._wait_on(event)
            self._pending_gpu.append(gpu_timing)
            self._drain_gpu_timing()
        feed._advance(after, finished=False)
        return self._export(batch)

    def _consumer_event(self):
        """Hand the previous batch's arrays back with an event on the consumer's stream."""
        dev = self._feed.device
        if not dev.is_cuda or self._held is None:
            return
        import cupy

        with cupy.cuda.Device(dev.index):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(_consumer_stream(self._feed.framework, dev))
        self._shared.retire.append((self._held, ev))
        self._held = None

    def _wait_on(self, event):
        dev = self._feed.device
        with dev.activate():
            _consumer_stream(self._feed.framework, dev).wait_event(event)

    def _drain_gpu_timing(self):
        while self._pending_gpu and self._pending_gpu[0][1].done:
            g0, g1 = self._pending_gpu.popleft()
            import cupy

            self._feed._record("gpu", cupy.cuda.get_elapsed_time(g0, g1) / 1000.0)

    def _export(self, batch):
        fw = self._feed.framework
        if fw is None:
            return batch
        for k in self._feed.task.array_fields:
            v = getattr(batch, k, None)
            if v is not None:
                setattr(batch, k, export(v, fw))
        batch.ids = export(batch.ids, fw) if fw in ("torch", "jax") else batch.ids
        return batch

    def _finish(self):
        self._done = True
        self._finalizer()
        if self._gen is not None:
            self._gen.close()
        if self._feed.device.is_cuda and (self._held is not None or self._shared.retire):
            # the producer has stopped: drop the held batches once the consumer is done
            try:
                with self._feed.device.activate():
                    _consumer_stream(self._feed.framework, self._feed.device).synchronize()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
            self._held = None
            self._shared.retire.clear()

    def close(self):
        """Stop the producer and join it (mid-epoch: the next ``iter`` starts the next epoch)."""
        if not self._done:
            self._finish()
            self._feed._abandon()

    def __del__(self):
        try:
            if not self._done:
                self._finish()
                self._feed._abandon()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _consumer_stream(framework, dev):
    """The consumer's current stream on ``dev``: torch's with ``framework="torch"``, else
    cupy's (call inside ``dev.activate()``)."""
    import cupy

    if framework == "torch":
        import torch

        ptr = torch.cuda.current_stream(dev.index).cuda_stream
        return cupy.cuda.ExternalStream(ptr, dev.index)
    return cupy.cuda.get_current_stream()


# Producer threads are daemons (a feed left unfinished must not keep the process alive), but a
# daemon thread inside a native call (a decoder, a CUDA library, DALI) when the interpreter
# finalizes is ended by pthread_exit as it takes the GIL back, and a C++ frame it unwinds
# through calls std::terminate: the process aborts at exit ("terminate called without an active
# exception", seen on the CPU with the image and the audio feeds). So the producers still
# running are stopped and joined by an atexit hook, before the interpreter finalizes.
_PRODUCERS: weakref.WeakSet = weakref.WeakSet()
_EXIT_HOOK = {"registered": False}
EXIT_WAIT_S = 30.0  # at most this long, over all producers, at interpreter exit


def _track_producer(shared) -> None:
    _PRODUCERS.add(shared)
    if not _EXIT_HOOK["registered"]:
        _EXIT_HOOK["registered"] = True
        atexit.register(stop_producers)


def stop_producers(wait_s: float | None = None) -> None:
    """Stop every producer thread still running and join it (the atexit hook above)."""
    deadline = time.monotonic() + (EXIT_WAIT_S if wait_s is None else wait_s)
    live = list(_PRODUCERS)
    for shared in live:
        shared.stop.set()
    for shared in live:
        _stop(shared, shared.q, shared.thread, timeout=max(0.0, deadline - time.monotonic()))


def _stop(shared, q, thread, timeout=30.0):
    shared.stop.set()
    if q is not None:
        try:
            while True:
                q.get_nowait()
        except queue.Empty:
            pass
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=timeout)
