"""Shared pieces of the augmentation operators: draw helpers, the op protocol and :class:`Chain`.

Every augmentation is two things:

* a parameter sampler ``sample_params(seed, epoch, ids, ..., xp)`` that draws only through
  :mod:`avpipe.ops.random` (so CPU and GPU draw the same parameters, and a resumed run draws
  what the uninterrupted one would have), returning a ``dict`` of arrays, one row per item;
* a pure function of ``(data, params)`` that applies them (given the same params it gives the
  same output, so a params dict can be stored and replayed).

An op object (:class:`Augment`) bundles the two; :class:`Chain` runs a list of them, drawing
each op's parameters from the data as it reaches that op (lengths after a speed change, the
frame size after a crop), and can hand back and replay the list of parameter dicts.
:meth:`Chain.from_config` builds one from the operators of :mod:`avpipe.ops.registry` (an
``Augment`` class, or a registered function as a :class:`FunctionOp`, which draws nothing).
"""

from __future__ import annotations

import numpy as np

from ..device import to_numpy
from . import random as R
from . import registry

__all__ = ["Augment", "Chain", "FunctionOp"]


# --- draw helpers --------------------------------------------------------------------------------


def as_ids(ids, n: int, xp):
    """Sample ids for ``n`` items: ``arange(n)`` by default; int64 on ``xp``."""
    if ids is None:
        return xp.arange(n, dtype=xp.int64)
    ids = xp.asarray(ids, dtype=xp.int64).reshape(-1)
    if ids.shape[0] != n:
        raise ValueError(f"ids must have one entry per item ({n}), got {ids.shape[0]}")
    return ids


def below(w, span, xp):
    """Integers uniform on ``[0, span)`` from uint32 words ``w`` by multiply-shift (exact
    integer arithmetic: identical on numpy and cupy). ``span`` broadcasts against ``w``; a span
    of 0 or less gives 0."""
    s = xp.maximum(xp.asarray(span, dtype=xp.int64), 0).astype(xp.uint64)
    return ((w.astype(xp.uint64) * s) >> xp.uint64(32)).astype(xp.int64)


def unit(w, xp):
    """float64 uniform on [0, 1) from uint32 words (``u * 2**-32``, exact on both devices)."""
    return w.astype(xp.float64) * (2.0**-32)


def applied(seed, stream, epoch, ids, p, xp):
    """bool [B]: whether each item's op is applied (probability ``p``; its own stream)."""
    if p >= 1.0:
        return xp.ones(ids.shape[0], dtype=bool)
    return R.bernoulli(seed, stream + ".p", epoch, ids, 1, p=float(p), xp=xp)[:, 0]


def host(x):
    """A host numpy copy (a no-op for numpy input)."""
    return x if isinstance(x, np.ndarray) else to_numpy(x)


def on(xp, x, dtype=None):
    """``x`` as an ``xp`` array (copies host <-> device as needed)."""
    if xp is np:
        x = host(x) if not isinstance(x, (int, float, list, tuple)) else x
        return np.asarray(x, dtype=dtype)
    return xp.asarray(x, dtype=dtype)


def uniform_range(rng, name):
    """``(lo, hi)`` from a pair, or ``(v, v)`` from one number."""
    if isinstance(rng, (int, float)):
        return float(rng), float(rng)
    try:
        lo, hi = (float(v) for v in rng)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number or a (low, high) pair, got {rng!r}") from None
    if hi < lo:
        raise ValueError(f"{name}: high must be >= low, got {rng!r}")
    return lo, hi


def gamma(seed, stream, epoch, ids, alpha: float, attempts: int = 16):
    """Gamma(alpha, 1) draws [B] (host float64) by Marsaglia-Tsang with a fixed number of
    attempts (first accepted wins; all rejected has probability < 1e-18 for any alpha); alpha
    below 1 by the boost ``Gamma(alpha + 1) * U ** (1 / alpha)``. Computed on the host from
    :mod:`avpipe.ops.random` draws, so every device gets the same values."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    a = alpha + 1.0 if alpha < 1.0 else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / np.sqrt(9.0 * d)
    z = R.normal(seed, stream + ".n", epoch, ids, attempts)
    u = R.uniform(seed, stream + ".u", epoch, ids, attempts + 1)
    v = (1.0 + c * z) ** 3
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = (v > 0) & (np.log(np.maximum(u[:, :attempts], 1e-300))
                        < 0.5 * z * z + d - d * v + d * np.log(np.where(v > 0, v, 1.0)))
    first = np.argmax(ok, axis=1)
    g = d * v[np.arange(v.shape[0]), first]
    g = np.where(ok.any(axis=1), g, d)  # never in practice
    if alpha < 1.0:
        g = g * np.maximum(u[:, attempts], 2.0**-33) ** (1.0 / alpha)
    return g


# --- ops and chains ------------------------------------------------------------------------------


class Augment:
    """One augmentation: :meth:`sample` draws its parameters for a batch, :meth:`apply` applies
    given parameters (pure). ``stream`` names its random stream (default: the op's name); two
    ops of one chain with the same name get ``name#1``, ``name#2``, ... so their draws differ.
    Deterministic ops (log-mel, normalize, centre crop) return ``{}`` from :meth:`sample`."""

    name = "augment"
    #: ``fuse(data, ops, params)``: applies a run of consecutive ops of a :class:`Chain` that
    #: share this function at once (e.g. one GPU kernel); None: the op is applied alone. Such
    #: ops' samplers may read only the batch size of the data (all of a run see its input).
    #: ``fuse.sample(data, ops, seed=, epoch=, ids=)``, where the function has it, draws the
    #: run's list of parameter dicts at once (equal to the ops' own samplers').
    fuse = None
    #: True: the op may only start a run of its ``fuse`` (its sampler reads more of the data
    #: than the batch size, so it must see the run's input).
    fuse_leads = False

    #: whether the op draws parameters (it has its own :meth:`sample`; set for each class)
    random = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.random = cls.sample is not Augment.sample

    def __init__(self, stream: str | None = None):
        self.stream = stream or self.name

    def sample(self, data, *, seed: int, epoch: int = 0, ids=None) -> dict:
        return {}

    def apply(self, data, params: dict):
        raise NotImplementedError

    def __call__(self, data, *, seed: int = 0, epoch: int = 0, ids=None,
                 return_params: bool = False):  # fmt: skip
        params = self.sample(data, seed=seed, epoch=epoch, ids=ids)
        out = self.apply(data, params)
        return (out, params) if return_params else out

    def __repr__(self):
        keys = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in keys.items())})"


class FunctionOp(Augment):
    """A registered operator function as a chain step (nothing drawn: ``fn(data, **args)``)."""

    def __init__(self, entry, args: dict, stream: str | None = None):
        self.name = entry.name
        super().__init__(stream)
        self.entry, self.args = entry, dict(args)

    def apply(self, data, params):
        return self.entry.target(data, **self.args)

    def __repr__(self):
        return f"FunctionOp({self.entry.name!r}, {self.args!r})"


class Chain(Augment):
    """Ops run in order: each draws its parameters from the data as it reaches it, then applies
    them. ``chain(data, seed=, epoch=, ids=, return_params=True)`` also returns the list of
    parameter dicts; ``chain.apply(data, params_list)`` replays them exactly.

    ``Chain.from_config([{"op": "speed_perturb", "factors": [0.9, 1.0, 1.1]}, ...])`` builds
    one from plain dicts (``"op"``: an operator of :mod:`avpipe.ops.registry`, the rest: its
    keyword arguments); ``Chain.ops_available()`` lists the names."""

    name = "chain"

    def __init__(self, ops, stream: str | None = None):
        super().__init__(stream)
        self.ops = list(ops)
        seen: dict[str, int] = {}
        for op in self.ops:
            if not isinstance(op, Augment):
                raise TypeError(f"Chain takes Augment ops, got {type(op).__name__}")
            seen[op.stream] = seen.get(op.stream, 0) + 1
        count: dict[str, int] = {}
        for op in self.ops:
            if seen[op.stream] > 1:
                count[op.stream] = count.get(op.stream, 0) + 1
                op.stream = f"{op.stream}#{count[op.stream]}"

    @staticmethod
    def ops_available():
        return registry.names()

    @classmethod
    def from_config(cls, config, *, kind: str | None = None):
        """A chain of the registered operators (:mod:`avpipe.ops.registry`) named by ``config``
        (``[{"op": name, **arguments}, ...]``; ``"stream"`` names an op's random stream).
        ``kind`` ("audio" or "image") picks the entry of a name registered for both
        (``normalize``); without it, the kind of the config's other ops."""
        kinds = []  # the kinds each entry's name may be
        for i, entry in enumerate(config):
            if not isinstance(entry, dict) or "op" not in entry:
                raise ValueError(f"config[{i}] must be a dict with an 'op' key, got {entry!r}")
            ks = [k for k in registry.kinds_of(entry["op"]) if kind is None or k == kind]
            if not ks:
                raise ValueError(f"config[{i}]: unknown op {entry['op']!r}; known: "
                                 f"{registry.names(kind=kind)}")
            kinds.append(ks)
        sure = {ks[0] for ks in kinds if len(ks) == 1}
        ops = []
        for i, (entry, ks) in enumerate(zip(config, kinds)):
            name = entry["op"]
            if len(ks) > 1 and (len(sure) != 1 or not sure <= set(ks)):
                raise ValueError(f"config[{i}]: op {name!r} is registered for "
                                 f"{' and '.join(ks)}; pass kind= to Chain.from_config")
            op = registry.get(name, ks[0] if len(ks) == 1 else next(iter(sure)))
            args = {k: v for k, v in entry.items() if k not in ("op", "stream")}
            try:
                op.check(args)
            except ValueError as e:
                raise ValueError(f"config[{i}] ({name}): {e}") from None
            stream = entry.get("stream")
            if op.is_class:
                ops.append(op.target(**args, **({"stream": stream} if stream else {})))
            else:
                ops.append(FunctionOp(op, args, stream=stream))
        return cls(ops)

    def _runs(self):
        """``(start, stop)`` of the runs of consecutive ops sharing a ``fuse`` (others alone)."""
        runs, i = [], 0
        while i < len(self.ops):
            j, f = i + 1, self.ops[i].fuse
            while (f is not None and j < len(self.ops) and self.ops[j].fuse is f
                   and not self.ops[j].fuse_leads):  # fmt: skip
                j += 1
            runs.append((i, j))
            i = j
        return runs

    def __call__(self, data, *, seed: int = 0, epoch: int = 0, ids=None,
                 return_params: bool = False):  # fmt: skip
        all_params = []
        for i, j in self._runs():
            if j - i == 1:
                data, p = self.ops[i](data, seed=seed, epoch=epoch, ids=ids, return_params=True)
                all_params.append(p)
                continue
            run, fuse = self.ops[i:j], self.ops[i].fuse
            sample = getattr(fuse, "sample", None)
            if sample is not None:
                ps = sample(data, run, seed=seed, epoch=epoch, ids=ids)
            else:
                ps = [op.sample(data, seed=seed, epoch=epoch, ids=ids) for op in run]
            data = fuse(data, run, ps)
            all_params.extend(ps)
        return (data, all_params) if return_params else data

    def sample(self, data, *, seed, epoch=0, ids=None):
        raise TypeError("a Chain samples while it runs: call it with return_params=True")

    def apply(self, data, params):
        if len(params) != len(self.ops):
            raise ValueError(f"params: {len(params)} dicts for {len(self.ops)} ops")
        for i, j in self._runs():
            if j - i == 1:
                data = self.ops[i].apply(data, params[i])
            else:
                data = self.ops[i].fuse(data, self.ops[i:j], list(params[i:j]))
        return data

    def __repr__(self):
        return "Chain([" + ", ".join(repr(o) for o in self.ops) + "])"

