"""Counter-based random draws: the same numbers on the CPU and the GPU, from any position.

Every random decision in avpipe (a shuffle, a crop, a mask, a speed factor) is a pure function
of ``(seed, stream, epoch, sample id, draw)``: Philox4x32-10 (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) keyed by the seed and the stream, with the epoch, the
sample id and the draw number as its counter. No generator state is carried from one sample to
the next, so

* a resumed run draws exactly what the uninterrupted run would have (nothing to replay);
* the CPU (numpy) and the GPU (cupy) compute the same 32-bit words: the rounds are integer
  multiplies and xors, written once against the array module;
* any item of any epoch is reachable in O(1).

Words become floats by ``u * 2**-32`` in float64, which is exact on both devices, so uniform
draws are bit-identical; draws through transcendental functions (:func:`normal`, log-uniform)
agree to a few ulps. Decisions that must match exactly compare integers or uniform floats.

``stream`` separates independent uses of one seed ("order", "crop", "speed", ...): a string is
hashed (FNV-1a, 32 bits) into the key, so adding a new stream never shifts another's draws.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import numpy as np

from ..device.cuda_modules import CudaModule, elementwise, read_fragments, table_args

__all__ = [
    "drawn_table",
    "philox4x32",
    "stream_key",
    "words",
    "words_many",
    "drawn_together",
    "draw_ahead",
    "drawn_from",
    "uniform",
    "integers",
    "normal",
    "bernoulli",
    "standard_normal",
]

_M0 = 0xD2511F53
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _xp_of(x):
    return np if isinstance(x, np.ndarray) else __import__("cupy").get_array_module(x)


# The CUDA text of the draws (_random.cu): the rounds as an elementwise kernel's body (the same
# integer steps as the numpy code below, its reference), as a device function (put before
# kernels that draw their own parameters), the standard normal draws of a whole array from a
# key alone (a dither's noise) and of each row's first lengths[b] elements.
_CUDA = read_fragments(__file__, "_random.cu")
PHILOX_BODY = _CUDA["philox_body"]
PHILOX_FUNCTION = _CUDA["philox_function"]
NORMAL_BODY = _CUDA["normal_body"]
NORMAL_ROWS_CUDA = _CUDA["normal_rows"]
_NORMAL_ROWS = CudaModule(__file__, table=True, prelude=NORMAL_ROWS_CUDA,
                          names=("avpipe_standard_normal_rows",))


def _philox_kernel():
    return elementwise(
        "uint32 c0, uint32 c1, uint32 c2, uint32 c3, uint32 k0, uint32 k1, int32 rounds",
        "uint32 o0, uint32 o1, uint32 o2, uint32 o3", PHILOX_BODY, "avpipe_philox4x32")


def _normal_kernel():
    return elementwise("uint32 k0, uint32 k1", "float32 z", NORMAL_BODY, "avpipe_standard_normal")


def _normal_rows_kernel(device_id: int):
    return _NORMAL_ROWS.get(device_id)["avpipe_standard_normal_rows"]


# Up to this many counters a draw runs Philox in Python integers instead of numpy, whose ~60
# operations on tiny arrays cost more than a few counters' Python arithmetic whatever the size
# (docs/how-it-works.md, "Measured trade-offs"): the per-item draws of a batch (a clip's start, crop
# box and flip: 1 to 10 counters each). Both give the same words bit for bit
# (tests/ops/test_random.py compares them).
_SMALL = 12


def _philox_ints(counters, k0: int, k1: int, rounds: int) -> list:
    """Philox4x32 of each ``(c0, c1, c2, c3)`` tuple of Python ints (each below 2**32) under the
    key ``(k0, k1)``: a list of 4-tuples of ints, the numpy rounds' integer steps one by one."""
    keys = []
    for _ in range(rounds):
        keys.append((k0, k1))
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    out = []
    for a0, a1, a2, a3 in counters:
        for key0, key1 in keys:
            p0 = a0 * 0xD2511F53  # _M0 (literals: no global lookups in the inner loop)
            p1 = a2 * 0xCD9E8D57  # _M1
            a0, a1, a2, a3 = ((p1 >> 32) ^ a1 ^ key0, p1 & 0xFFFFFFFF,
                              (p0 >> 32) ^ a3 ^ key1, p0 & 0xFFFFFFFF)  # fmt: skip
        out.append((a0, a1, a2, a3))
    return out


def _normal_rows(cupy, k0, k1, lens, shape):
    """:func:`standard_normal` with ``lengths`` on a GPU: one launch."""
    B, n = shape
    out = cupy.empty(shape, cupy.float32)
    if out.size:
        tab, inl, (lens_arg,) = table_args(cupy, [lens])
        threads = 256
        grid = (min(-(-n // threads), 65535), min(B, 65535))
        _normal_rows_kernel(cupy.cuda.Device().id)(
            grid, (threads,), (np.uint32(k0), np.uint32(k1), lens_arg, np.int64(B), np.int64(n),
                               out, tab, np.int32(inl)))  # fmt: skip
    return out


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = 10):
    """Philox4x32 on four uint32 counter arrays (numpy or cupy, same shape) and a 64-bit key
    given as two Python ints; returns four uint32 arrays (the random words). On cupy: one
    kernel launch (:data:`PHILOX_BODY`)."""
    xp = _xp_of(c0)
    u32 = xp.uint32
    c0, c1, c2, c3 = (xp.asarray(c, dtype=u32) for c in (c0, c1, c2, c3))
    k0, k1 = int(k0) & _MASK32, int(k1) & _MASK32
    if xp is not np:
        return _philox_kernel()(c0, c1, c2, c3, np.uint32(k0), np.uint32(k1),
                                  np.int32(rounds))
    c0, c1, c2, c3 = np.broadcast_arrays(c0, c1, c2, c3)  # (as the cupy kernel broadcasts)
    shape = c0.shape
    if 0 < c0.size <= _SMALL and shape == c1.shape == c2.shape == c3.shape:
        r = _philox_ints(zip(*(c.ravel().tolist() for c in (c0, c1, c2, c3))), k0, k1,
                         rounds)  # fmt: skip
        return tuple(np.array(col, np.uint32).reshape(shape) for col in zip(*r))
    a, b = philox_lanes(np.stack([c0, c2]), np.stack([c1, c3]),
                        _round_keys(k0, k1, rounds).reshape((rounds, 2) + (1,) * len(shape)))
    return a[0].astype(u32), b[0].astype(u32), a[1].astype(u32), b[1].astype(u32)


_PHILOX_M = np.array([_M0, _M1], np.uint64)
_U32 = np.uint64(_MASK32)
_S32 = np.uint64(32)


@functools.lru_cache(maxsize=256)
def _round_keys(k0: int, k1: int, rounds: int) -> np.ndarray:
    """uint64 ``[rounds, 2]``: the key of each round (the Weyl sequence of ``(k0, k1)``)."""
    r = np.arange(rounds, dtype=np.uint64)[:, None]
    keys = (np.array([k0, k1], np.uint64)[None, :] + r * np.array([_W0, _W1], np.uint64)) & _U32
    keys.setflags(write=False)
    return keys


def philox_lanes(a, b, round_keys):
    """The numpy Philox4x32 rounds on lanes kept as uint64 pairs: ``a = [c0, c2]``, ``b = [c1,
    c3]`` (axis 0 of each; any shape after it, values below 2**32) under ``round_keys``
    (``[rounds, 2, ...]``, broadcasting against them: one key for all, or one per column).
    Returns the final ``(a, b)`` (uint64 pairs): the same integer steps as :data:`PHILOX_BODY`
    with five array operations a round."""
    a = np.asarray(a, np.uint64)
    b = np.asarray(b, np.uint64)
    round_keys = np.asarray(round_keys, np.uint64)
    m = _PHILOX_M.reshape((2,) + (1,) * (a.ndim - 1))
    for key in round_keys:
        p = a * m  # a0 * M0, a2 * M1 (exact: below 2**64)
        a = (p[::-1] >> _S32) ^ b ^ key  # hi1 ^ a1 ^ k0, hi0 ^ a3 ^ k1
        b = (p & _U32)[::-1]  # lo1, lo0
    return a, b


_LITTLE = sys.byteorder == "little"
_PHILOX_M2 = np.array([_M0, _M1], np.uint64).reshape(2, 1)


def philox_lanes32(a, b, round_keys):
    """:func:`philox_lanes` on uint32 lanes ``a = [c0, c2]``, ``b = [c1, c3]`` (``[2, n]``)
    under uint32 ``round_keys`` ``[rounds, 2, n or 1]``; returns the final ``(a, b)`` as uint32
    ``[2, n]``. Each round is one widening multiply whose 64-bit products are read back as
    their 32-bit halves (a little-endian view) and two xors: the same words, for fewer array
    operations than the uint64 lanes' five."""
    if not _LITTLE:
        x, y = philox_lanes(a, b, np.asarray(round_keys, np.uint64))
        return x.astype(np.uint32), y.astype(np.uint32)
    a = np.asarray(a, np.uint32)
    b = np.asarray(b, np.uint32)
    for key in round_keys:
        v = np.multiply(a, _PHILOX_M2).view(np.uint32)  # [2, 2n]: (lo, hi) of each product
        a = v[::-1, 1::2] ^ b  # hi1 ^ a1 ^ k0, hi0 ^ a3 ^ k1
        a ^= key
        b = v[::-1, 0::2]  # lo1, lo0
    return a, b


@functools.lru_cache(maxsize=1024)
def _fnv1a(stream: str) -> int:
    """FNV-1a (32 bits) of a stream name's UTF-8 bytes."""
    h = 0x811C9DC5
    for b in stream.encode():
        h = ((h ^ b) * 0x01000193) & _MASK32
    return h


def stream_key(seed: int, stream: str | int) -> tuple[int, int]:
    """The Philox key for ``(seed, stream)``: ``stream`` a name (hashed) or an int."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if isinstance(stream, str):
        h = _fnv1a(stream)
    else:
        h = int(stream) & _MASK32
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return (s & _MASK32) ^ h, (s >> 32) ^ 0x5BD1E995


def words(seed, stream, epoch, ids, n: int, *, xp=np):
    """uint32 ``[len(ids), n]``: ``n`` random words for each sample id of ``ids`` in ``epoch``.

    Word ``j`` of sample ``i`` depends only on (seed, stream, epoch, ids[i], j)."""
    ids = xp.asarray(ids, dtype=xp.int64).reshape(-1)
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    blocks = (n + 3) // 4
    k0, k1 = stream_key(seed, stream)
    if xp is np:
        ahead = getattr(_AHEAD, "words", None)
        if ahead is not None:  # inside drawn_from / drawn_together: drawn already?
            hit = ahead.get((seed, stream, int(epoch), n))
            if hit is not None:
                drawn_ids, drawn, row_of = hit
                if drawn_ids.shape == ids.shape and (drawn_ids == ids).all():
                    return drawn.copy()
                rows = [row_of.get(i) for i in ids.tolist()]  # some of the drawn ids
                if None not in rows:
                    return drawn[rows]
    if xp is np and 0 < ids.shape[0] * blocks <= _SMALL:  # a few counters: Python integers
        e = int(epoch) & _MASK32
        r = _philox_ints([(i & _MASK32, (i >> 32) & _MASK32, e, b)
                          for i in ids.tolist() for b in range(blocks)], k0, k1, 10)  # fmt: skip
        return np.array(r, np.uint32).reshape(ids.shape[0], blocks * 4)[:, :n]
    idv = ids[:, None]
    blk = xp.arange(blocks, dtype=xp.int64)[None, :]
    shape = (ids.shape[0], blocks)
    c0 = xp.broadcast_to(idv & _MASK32, shape).astype(xp.uint32)
    c1 = xp.broadcast_to((idv >> 32) & _MASK32, shape).astype(xp.uint32)
    c2 = xp.full(shape, int(epoch) & _MASK32, dtype=xp.uint32)
    c3 = xp.broadcast_to(blk, shape).astype(xp.uint32)
    r = philox4x32(c0, c1, c2, c3, k0, k1)
    out = xp.stack(r, axis=-1).reshape(ids.shape[0], blocks * 4)
    return out[:, :n]


@functools.lru_cache(maxsize=64)
def _columns(seed, requests, B):
    """What :func:`words_many`'s counters share from call to call: every column's round keys
    (uint32 ``[10, 2, B * nb]``) and block number, and each request's block count (column
    ``j``: item ``j // nb``)."""
    blocks = []
    for _, n in requests:
        if int(n) < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        blocks.append((int(n) + 3) // 4)
    # each stream's round keys, once per block of its words
    per = [np.repeat(_round_keys(*stream_key(seed, s), 10)[:, :, None], nb, axis=2)
           for (s, _), nb in zip(requests, blocks)]
    kr = np.tile(np.concatenate(per, axis=2) if per else np.zeros((10, 2, 0), np.uint64),
                 (1, 1, B)).astype(np.uint32)  # fmt: skip
    blk = np.tile(np.concatenate([np.arange(b, dtype=np.uint32) for b in blocks] or [[]]),
                  B).astype(np.uint32)  # fmt: skip
    for a in (kr, blk):
        a.setflags(write=False)
    return kr, blk, tuple(blocks)


def words_many(seed, epoch, ids, requests):
    """``[words(seed, stream, epoch, ids, n) for stream, n in requests]`` (host ``ids``) in one
    numpy Philox pass over all their counters, each column under its stream's key: the same
    words bit for bit, for the cost of one draw of small arrays rather than one per stream
    (a batch's draws of several augmentations)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    B = ids.shape[0]
    requests = tuple((s, int(n)) for s, n in requests)
    kr, blk, blocks = _columns(seed, requests, B)
    nb = sum(blocks)
    if B == 0 or nb == 0:
        return [np.zeros((B, n), np.uint32) for _, n in requests]
    a = np.empty((2, B * nb), np.uint32)  # lanes 0 (id low), 2 (epoch)
    a[0] = np.repeat(ids & _MASK32, nb)
    a[1] = int(epoch) & _MASK32
    b = np.empty((2, B * nb), np.uint32)  # lanes 1 (id high), 3 (block)
    b[0] = np.repeat((ids >> 32) & _MASK32, nb)
    b[1] = blk
    a, b = philox_lanes32(a, b, kr)
    w = np.empty((B * nb, 4), np.uint32)
    w[:, 0], w[:, 1], w[:, 2], w[:, 3] = a[0], b[0], a[1], b[1]
    w = w.reshape(B, nb * 4)
    out, c = [], 0
    for (_, n), nbk in zip(requests, blocks):
        out.append(w[:, 4 * c : 4 * c + n])
        c += nbk
    return out


_AHEAD = threading.local()


def draw_ahead(seed, epoch, ids, requests) -> dict:
    """The words of ``(seed, stream, epoch, ids, n)`` for each ``(stream, n)`` of ``requests``,
    drawn now in one :func:`words_many` pass, as a table for :func:`drawn_from` (read-only:
    several threads may draw from one table)."""
    return draw_ahead_groups(seed, epoch, [ids], requests)[0]


def draw_ahead_groups(seed, epoch, groups, requests) -> list:
    """:func:`draw_ahead` of each id list of ``groups`` (a feed's next batches), all in one
    :func:`words_many` pass: the same tables, for one pass's cost (a pass over a few hundred
    counters costs about what one over a few does)."""
    parts = [np.asarray(g, np.int64).reshape(-1) for g in groups]
    sizes = [p.shape[0] for p in parts]
    # (a copy: ids changed later by the caller do not change the table)
    ids_h = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    requests = [(s, int(n)) for s, n in requests]
    got = words_many(seed, epoch, ids_h, requests)
    e = int(epoch)
    out, start = [], 0
    for n in sizes:
        part = ids_h[start : start + n]
        row_of = {}
        for r, i in enumerate(part.tolist()):
            row_of.setdefault(i, r)
        out.append({(seed, s, e, k): (part, w[start : start + n], row_of)
                    for (s, k), w in zip(requests, got)})  # fmt: skip
        start += n
    return out


@contextlib.contextmanager
def drawn_from(table):
    """Inside the block, this thread's host :func:`words` that ``table`` (:func:`draw_ahead`)
    holds, for all of its ids or some of them, come from it: the same words, without a Philox
    pass (a batch's draws made once, then read by the threads that decode its items)."""
    outer = getattr(_AHEAD, "words", None)
    _AHEAD.words = {**outer, **table} if outer else table
    try:
        yield
    finally:
        _AHEAD.words = outer


def drawn_table():
    """The table :func:`drawn_from` gives this thread now (None outside one): for work that
    a later step draws for with the same table."""
    return getattr(_AHEAD, "words", None)


@contextlib.contextmanager
def drawn_together(seed, epoch, ids, requests):
    """Inside the block, this thread's host :func:`words` of ``(seed, stream, epoch, ids, n)``
    for each ``(stream, n)`` of ``requests`` come from one :func:`words_many` pass made on
    entry: the same words, one Philox pass for all of a batch's draws instead of one per
    sampler (a recipe wraps its collate's samplers; a request no sampler makes, or a sampler
    that asks for something else, costs nothing wrong, only the saving)."""
    with drawn_from(draw_ahead(seed, epoch, ids, requests)):
        yield


def uniform(seed, stream, epoch, ids, n: int = 1, *, low=0.0, high=1.0, xp=np):
    """float64 ``[len(ids), n]`` uniform on ``[low, high)``; bit-identical on CPU and GPU."""
    u = words(seed, stream, epoch, ids, n, xp=xp).astype(xp.float64) * (2.0**-32)
    return low + (high - low) * u


def integers(seed, stream, epoch, ids, n: int = 1, *, low: int = 0, high: int, xp=np):
    """int64 ``[len(ids), n]`` uniform on ``[low, high)`` (``high`` exclusive), by multiply-shift
    of a 32-bit word (bias below 2**-32 * (high - low)); identical on CPU and GPU."""
    span = int(high) - int(low)
    if span <= 0:
        raise ValueError(f"high must be > low, got low={low}, high={high}")
    if span > _MASK32:
        raise ValueError(f"high - low must be < 2**32, got {span}")
    w = words(seed, stream, epoch, ids, n, xp=xp).astype(xp.uint64)
    return (w * xp.uint64(span) >> xp.uint64(32)).astype(xp.int64) + int(low)


def bernoulli(seed, stream, epoch, ids, n: int = 1, *, p: float, xp=np):
    """bool ``[len(ids), n]``: True with probability ``p``; identical on CPU and GPU."""
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    return uniform(seed, stream, epoch, ids, n, xp=xp) < float(p)


def normal(seed, stream, epoch, ids, n: int = 1, *, mean=0.0, std=1.0, xp=np):
    """float64 ``[len(ids), n]`` normal draws (Box-Muller); CPU and GPU agree to a few ulps."""
    w = words(seed, stream, epoch, ids, 2 * int(n), xp=xp).astype(xp.float64)
    u1 = (w[:, 0::2] + 1.0) * (2.0**-32)  # (0, 1]: log is finite
    u2 = w[:, 1::2] * (2.0**-32)
    z = xp.sqrt(-2.0 * xp.log(u1)) * xp.cos(2.0 * np.pi * u2)
    return mean + std * z


def standard_normal(seed, stream, shape, *, lengths=None, xp=np):
    """float32 standard normal draws filling ``shape``, a function of ``(seed, stream)`` and
    each element's flat index alone (:data:`NORMAL_BODY`): the noise of a whole batch (a
    dither) in one pass, where :func:`normal` draws a few values per sample id. On cupy one
    kernel; numpy computes the same values (to float64 rounding in log / cos: equal, or one
    float32 step apart) at about 150 ns an element, the reference for small arrays.

    ``lengths`` (host ints, one per row of a 2-D ``shape``): only each row's first
    ``lengths[b]`` elements are drawn, the rest are 0 (a padded batch's noise without the
    padding's draws); the drawn ones equal the whole array's."""
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    k0, k1 = stream_key(seed, stream)
    if lengths is not None:
        if not isinstance(lengths, (np.ndarray, list, tuple, range)):
            raise TypeError(f"lengths must be host integers (a list or a numpy array), got "
                            f"{type(lengths).__name__}")
        lens = np.asarray(lengths, np.int64).reshape(-1)
        if len(shape) != 2 or lens.shape[0] != shape[0]:
            raise ValueError(f"lengths must give one length per row of a 2-D shape, got "
                             f"{lens.shape[0]} lengths for shape {shape}")
        lens = np.clip(lens, 0, shape[1])
        if xp is not np:
            return _normal_rows(xp, k0, k1, lens, shape)
        z = standard_normal(seed, stream, shape)
        z[np.arange(shape[1])[None, :] >= lens[:, None]] = 0
        return z
    if xp is not np:
        out = xp.empty(shape, xp.float32)
        if out.size:
            _normal_kernel()(np.uint32(k0), np.uint32(k1), out)
        return out
    n = int(np.prod(shape, dtype=np.int64))
    c = np.arange((n + 1) // 2, dtype=np.uint64)
    zero = np.zeros_like(c)
    a, b = philox_lanes(np.stack([c & _U32, zero]), np.stack([c >> _S32, zero]),
                        _round_keys(k0, k1, 10).reshape(10, 2, 1))
    u = np.stack([a[0], a[1]], axis=1).reshape(-1)[:n]  # o0 for even elements, o2 for odd
    v = np.stack([b[0], b[1]], axis=1).reshape(-1)[:n]  # o1, o3
    r = np.sqrt(-2.0 * np.log((u.astype(np.float64) + 1.0) * 2.0**-32))
    z = r * np.cos(2.0 * np.pi * (v.astype(np.float64) * 2.0**-32))
    return z.astype(np.float32).reshape(shape)
