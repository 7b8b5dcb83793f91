"""A mel filterbank's product with spectra as fixed-order sums over each filter's few nonzero
bins (private). The CPU log-mel path (:mod:`avpipe.ops._log_mel`) and the array-module
reference (:mod:`avpipe.ops._audio_core`) both apply their filters with it, so an item's
features are the same bits in any batch and on any number of threads."""

from __future__ import annotations

import numpy as np

__all__ = ["SparseRows"]


class SparseRows:
    """A matrix ``w [K, F]`` whose rows are nonzero over a short span of columns each (a mel
    filterbank: at most 18 of 257 bins a filter at 16 kHz), kept for :meth:`apply`: its rows
    in contiguous groups, each group ``(k0, k1, start, weights)`` with row ``k``'s entries
    from column ``start[k - k0]`` on (``weights [J, k1 - k0]``: ``weights[j, k - k0] = w[k,
    start + j]``, 0 past the row's last nonzero entry). The groups are chosen so that rows of
    similar spans share one (a group costs its widest span for each of its rows). A dense
    ``w`` is one group, its spans ``F`` wide."""

    def __init__(self, w):
        w = np.asarray(w)
        K, F = w.shape
        self.shape = (K, F)
        nz = w != 0
        any_nz = nz.any(axis=1)
        first = np.where(any_nz, nz.argmax(axis=1), 0).astype(np.int64)
        last = np.where(any_nz, F - 1 - nz[:, ::-1].argmax(axis=1), -1).astype(np.int64)
        width = np.maximum(last - first + 1, 0)
        # cheapest split into contiguous groups: a group of rows k0..k1 costs its widest
        # span times (its rows + a fixed cost for the three calls a span step makes)
        best = [0.0] + [float("inf")] * K
        cut = [0] * (K + 1)
        for k1 in range(1, K + 1):
            J = 0
            for k0 in range(k1 - 1, -1, -1):
                J = max(J, int(width[k0]))
                c = best[k0] + J * ((k1 - k0) + 16)
                if c < best[k1]:
                    best[k1], cut[k1] = c, k0
        bounds = []
        k1 = K
        while k1 > 0:
            bounds.append((cut[k1], k1))
            k1 = cut[k1]
        self.groups = []
        self._cast: dict = {}
        for k0, k1 in reversed(bounds):
            J = int(width[k0:k1].max())
            rows = np.arange(k0, k1)
            weights = np.zeros((J, k1 - k0), w.dtype)
            for j in range(J):
                col = first[k0:k1] + j
                ok = col <= last[k0:k1]
                weights[j, ok] = w[rows[ok], col[ok]]
            # where a weight is 0 past F, any column will do (0 times a finite value)
            starts = np.minimum(first[k0:k1][None, :] + np.arange(J)[:, None], F - 1)
            self.groups.append((k0, k1, starts, weights))
        self._widest = max((k1 - k0 for k0, k1, _, _ in self.groups), default=0)

    def _weights_in(self, dtype) -> list:
        """Each group's weights in ``dtype``, shaped ``[J, k, 1]``, cast once per dtype (a
        log-mel applies the same filters to every chunk of every item)."""
        dtype = np.dtype(dtype)
        ws = self._cast.get(dtype)
        if ws is None:
            ws = self._cast[dtype] = [g[3].astype(dtype)[..., None] for g in self.groups]
        return ws

    def apply(self, s, out=None):
        """``w @ s`` for ``s [F, N]`` (or ``[..., F, N]``) in ``s``'s dtype: ``out[k] =
        sum_j weights[j, k] * s[start[k] + j]``, accumulated in the order of ``j`` by
        elementwise operations only. Every output column is a function of that column of
        ``s`` alone, in the same operations whatever ``N``, the other columns or the number
        of threads, which a BLAS product is not (its order of sums depends on the matrix's
        shape and on its threads)."""
        K, F = self.shape
        if s.shape[-2] != F:
            raise ValueError(f"s must have {F} rows, got shape {tuple(s.shape)}")
        lead, N = s.shape[:-2], s.shape[-1]
        if out is None:
            out = np.empty((*lead, K, N), s.dtype)
        # one buffer, each group's rows of it
        scratch = np.empty((*lead, self._widest, N), s.dtype)
        for (k0, k1, starts, weights), w in zip(self.groups, self._weights_in(s.dtype)):
            o = out[..., k0:k1, :]
            if weights.shape[0] == 0:
                o[...] = 0
                continue
            tmp = scratch[..., : k1 - k0, :]
            for j in range(weights.shape[0]):
                np.take(s, starts[j], axis=-2, out=tmp, mode="clip")  # "raise" copies out
                if j == 0:
                    np.multiply(tmp, w[0], out=o)
                else:
                    tmp *= w[j]
                    o += tmp
        return out
