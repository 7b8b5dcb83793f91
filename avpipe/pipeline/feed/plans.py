"""Epoch order for the training feeds: a counter-based permutation, batches, shards, buckets.

Everything here is a pure function of ``(seed, epoch, n, ...)``: nothing is carried from one
epoch (or one batch) to the next, so any position of any epoch is reached without replaying.

* :func:`permute` / :func:`permutation` — a keyed Feistel bijection on ``[0, n)`` (cycle-walking
  from the next power of four), its round function the Philox words of
  :mod:`avpipe.ops.random` (stream ``"order"``). ``permute(i)`` costs O(1) per position; a
  whole epoch of 1M items takes about 3 s on one CPU core (numpy), once per epoch.
* :func:`plan_fixed` — cut an ordered sequence into ``batch_size`` batches for ``world_size``
  ranks: every rank gets the same number of batches (the remainder rule below).
* :func:`plan_buckets` — duration bucketing under ``max_duration`` seconds of *padded* audio per
  batch (``len(batch) * max(durations) <= max_duration``), batches shuffled, count made a
  multiple of ``world_size``.

A plan is a list of global batches (int64 arrays of item indices); global batch ``k`` belongs
to step ``k // world_size`` and rank ``k % world_size``.

Remainder rule (fixed batch size): with ``m`` items, ``W`` ranks and batch ``B``, every rank
gets ``ceil(m / (W * B))`` batches. All steps but the last are ``W`` full batches of
consecutive items; the last step's ``t = m - (steps - 1) * W * B`` items are dealt as evenly
as possible (rank ``r`` gets ``t // W + (r < t % W)`` consecutive items), so the ranks' items
are disjoint and together all ``m`` items. When ``t < W`` (fewer items left than ranks) the
last two steps' ``W * B + t`` items are dealt evenly over their ``2 * W`` batches instead (each
at least ``B // 2``). Only when the whole epoch has fewer items than ranks (``m < W``) is the
last step padded by wrapping to the epoch's first items (they appear twice); likewise with
``B = 1`` when ``t < W``, and for buckets when there are fewer batches than ranks after
halving them all. With ``pad="empty"`` (the feeds' ``training=False`` / ``train=False``)
those ranks get empty batches instead: every item exactly once per epoch across the ranks.
"""

from __future__ import annotations

import numpy as np

from ...ops import random as _rnd

__all__ = ["permutation", "permute", "plan_fixed", "plan_buckets", "steps_fixed"]

_ROUNDS = 6


def _bits(n: int) -> int:
    """Half-width of the Feistel domain: the smallest h with 4**h >= n (h >= 1)."""
    h = 1
    while (1 << (2 * h)) < n:
        h += 1
    return h


def _feistel(x: np.ndarray, h: int, seed: int, epoch: int, stream: str) -> np.ndarray:
    """One pass of the balanced Feistel network on ``[0, 4**h)`` (a bijection)."""
    mask = (1 << h) - 1
    k0, k1 = _rnd.stream_key(seed, stream)
    left, right = x >> h, x & mask
    c2 = np.full(x.shape, int(epoch) & 0xFFFFFFFF, np.uint32)
    zero = np.zeros(x.shape, np.uint32)
    for r in range(_ROUNDS):
        # round r's function: the first Philox4x32-10 word at counter (right, 0, epoch, r)
        # under the key of (seed, stream) (ops.random's generator and key schedule)
        f = _rnd.philox4x32(right.astype(np.uint32), zero, c2, np.full(x.shape, r, np.uint32),
                            k0, k1)[0].astype(np.int64)
        left, right = right, (left ^ f) & mask
    return (left << h) | right


def permute(i, n: int, *, seed: int, epoch: int, stream: str = "order") -> np.ndarray:
    """Positions ``i`` (array-like of ints in ``[0, n)``) -> the items at those positions of
    epoch ``epoch``'s permutation of ``[0, n)``. O(1) per position (cycle-walking: at most a
    few passes on average, since the domain is under ``4 * n``)."""
    n = int(n)
    i = np.asarray(i, dtype=np.int64).reshape(-1)
    if n <= 1:
        return np.zeros_like(i)
    if i.size and (i.min() < 0 or i.max() >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    h = _bits(n)
    x = i.copy()
    todo = np.arange(x.size)
    while todo.size:
        x[todo] = _feistel(x[todo], h, int(seed), int(epoch), stream)
        todo = todo[x[todo] >= n]  # cycle-walk the ones that left [0, n)
    return x


def permutation(n: int, *, seed: int, epoch: int, shuffle: bool = True,
                stream: str = "order") -> np.ndarray:
    """The whole order of epoch ``epoch`` (int64 ``[n]``); ``shuffle=False``: ``arange(n)``."""
    if not shuffle:
        return np.arange(int(n), dtype=np.int64)
    return permute(np.arange(int(n)), n, seed=seed, epoch=epoch, stream=stream)


def grouped_permutation(groups, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's order with each group's items together (``groups``: a group id per item, a
    shard's number): the groups in a permutation of them (stream ``"order.groups"``), each
    group's items in a permutation of their own (stream ``"order.group.<id>"``). Reads then
    go through one shard at a time, at the cost of batches drawn from fewer shards.
    ``shuffle=False``: the groups and their items in the list's order."""
    groups = np.asarray(groups, dtype=np.int64).reshape(-1)
    if groups.size == 0:
        return np.zeros(0, np.int64)
    uniq, first, inv = np.unique(groups, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first, kind="stable"), kind="stable")  # groups in list order
    members = np.argsort(rank[inv], kind="stable")
    counts = np.bincount(rank[inv], minlength=len(uniq))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    g_order = permutation(len(uniq), seed=seed, epoch=epoch, shuffle=shuffle,
                          stream="order.groups")
    out = []
    for g in g_order:
        m = members[starts[g]: starts[g] + counts[g]]
        out.append(m[permutation(len(m), seed=seed, epoch=epoch, shuffle=shuffle,
                                 stream=f"order.group.{int(g)}")])
    return np.concatenate(out)


def steps_fixed(m: int, batch_size: int, world_size: int) -> int:
    """Batches per rank for ``m`` items (the remainder rule: ``ceil(m / (W * B))``)."""
    if m <= 0:
        return 0
    return -(-int(m) // (int(world_size) * int(batch_size)))


def plan_fixed(seq, batch_size: int, world_size: int, *, pad: str = "repeat") -> list:
    """Global batches of ``seq`` (items in order) under the remainder rule (module docstring);
    ``pad="empty"``: where that rule wraps, empty batches instead (every item exactly once)."""
    seq = np.asarray(seq, dtype=np.int64)
    m, B, W = len(seq), int(batch_size), int(world_size)
    steps = steps_fixed(m, B, W)
    if steps == 0:
        return []
    full = (steps - 1) * W * B
    tail_steps = 1
    if m - full < W and steps >= 2 and B >= 2:  # too few for one a rank: balance two steps
        full -= W * B
        tail_steps = 2
    out = [seq[k * B : (k + 1) * B] for k in range(full // B)]
    tail = seq[full:]
    if len(tail) < W and pad == "repeat":  # fewer items than ranks: wrap to the first ones
        tail = np.concatenate([tail, np.resize(seq, W - len(tail))])
    t, parts = len(tail), W * tail_steps
    a = 0
    for r in range(parts):
        k = t // parts + (1 if r < t % parts else 0)
        out.append(tail[a : a + k])
        a += k
    return out


def plan_buckets(seq, durations, max_duration: float, world_size: int, *, seed: int, epoch: int,
                 window: int = 100, shuffle: bool = True, pad: str = "repeat") -> list:
    """Duration buckets: windows of ``window * (typical batch)`` items of ``seq`` are sorted by
    duration and cut greedily into batches whose padded duration ``len * max(duration)`` stays
    within ``max_duration``; the batches are then shuffled (stream ``"buckets"``) and, while
    their count is not a multiple of ``world_size``, the batch with most items is halved (a
    half never exceeds the whole's padded duration). Items longer than ``max_duration`` must
    have been left out before (the feed reports them)."""
    seq = np.asarray(seq, dtype=np.int64)
    durations = np.asarray(durations, dtype=np.float64)
    W = int(world_size)
    if len(seq) == 0:
        return []
    d = durations[seq]
    if np.any(d > max_duration):
        raise ValueError("an item is longer than max_duration (filter such items first)")
    typical = max(1, int(max_duration / max(float(np.median(d)), 1e-9)))
    win = max(1, int(window) * typical)
    batches = []
    for a in range(0, len(seq), win):
        part = seq[a : a + win]
        part = part[np.argsort(durations[part], kind="stable")]
        d = durations[part]
        i = 0
        while i < len(part):
            # ascending durations: the batch from i ends at the last j with (j-i+1)*d[j] <= max
            lo, hi = i, len(part) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if (mid - i + 1) * d[mid] <= max_duration:
                    lo = mid
                else:
                    hi = mid - 1
            batches.append(part[i : lo + 1].copy())
            i = lo + 1
    if shuffle and len(batches) > 1:
        order = permutation(len(batches), seed=seed, epoch=epoch, stream="buckets")
        batches = [batches[i] for i in order]
    return make_divisible(batches, W, pad=pad)


def make_divisible(batches: list, world_size: int, *, pad: str = "repeat") -> list:
    """Halve the largest batch (first of equals) until the count is a multiple of
    ``world_size``; with too few items for that, wrap-pad with copies of the first batches
    (``pad="empty"``: with empty batches)."""
    W = int(world_size)
    batches = list(batches)
    if not batches:
        return batches
    while len(batches) % W:
        sizes = [len(b) for b in batches]
        k = int(np.argmax(sizes))
        if sizes[k] < 2:
            break
        b = batches[k]
        h = (len(b) + 1) // 2
        batches[k : k + 1] = [b[:h], b[h:]]
    i = 0
    while len(batches) % W:  # fewer items than ranks: repeat (documented), or empty
        batches.append(batches[i] if pad == "repeat" else np.zeros(0, np.int64))
        i += 1
    return batches
