"""One loader for avpipe's CUDA kernels, and the small tables their launches carry.

Every kernel source is a ``.cu`` file beside the Python module that launches it. That module
declares its kernels once, at import (nothing is read or compiled then)::

    _KERNELS = CudaModule(__file__, "_resample.cu", names=("avpipe_resample_rows", ...),
                          table=True)

and takes them where it launches them: ``_KERNELS.get(device_id)`` is ``{name: function}``,
compiled by NVRTC (``cupy.RawModule``) on first use and cached per (source, options, device)
for the process. ``table=True`` puts :data:`TABLE_CUDA` (``AvpTable``, ``avp_tab``: see below)
before the module's files; ``prelude`` puts other text before them (a shared device function).

A source that does not compile (NVRTC missing or failing) is handled one way everywhere: a
module with an array-module path to fall back to names it (``fallback="image resize"``), and
then ``get`` logs one warning for that module and returns None, once and for all (the caller
takes its array-module path); a module without one (no ``fallback``) raises the error, and the
next call tries again. Elementwise kernels (:func:`elementwise`) are built here too; CuPy
compiles those per device on their first launch.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import numpy as np

from . import transfers

__all__ = [
    "CudaModule",
    "elementwise",
    "read_source",
    "read_fragments",
    "clear_cache",
    "TABLE_BYTES",
    "TABLE_CUDA",
    "NO_TABLE",
    "launch_table",
    "table_args",
]

log = logging.getLogger("avpipe")

_HERE = os.path.dirname(os.path.abspath(__file__))


def _read(folder: str, name: str) -> str:
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return f.read()


@functools.cache
def read_source(folder: str, files: tuple, prelude: str = "", table: bool = False) -> str:
    """The text NVRTC compiles for ``files`` (names in ``folder``, in order): :data:`TABLE_CUDA`
    first where ``table``, then ``prelude``, then the files. Read once: the same string object
    on every call (a compiled module's cache key)."""
    parts = [TABLE_CUDA] if table else []
    parts.append(prelude)
    parts += [_read(folder, f) for f in files]
    return "".join(parts)


@functools.cache
def read_fragments(module_file: str, name: str) -> dict:
    """The fragments of the ``.cu`` file ``name`` beside ``module_file``: kernel text that
    Python puts together (an elementwise kernel's body, a device function put before other
    sources). Each fragment follows a ``//@@ fragment`` line; a line that is ``@other@``
    alone stands for that other fragment's text. Returns ``{fragment: text}``."""
    raw: dict = {}
    current = None
    for line in _read(os.path.dirname(os.path.abspath(module_file)), name).splitlines(True):
        if line.startswith("//@@ "):
            current = line[5:].strip()
            raw[current] = []
        elif current is not None:
            raw[current].append(line)
    done: dict = {}

    def text(key, seen=()):
        if key not in done:
            if key in seen:
                raise ValueError(f"{name}: fragment {key!r} includes itself")
            out = []
            for line in raw[key]:
                ref = line.strip()
                if len(ref) > 2 and ref[0] == ref[-1] == "@" and ref[1:-1] in raw:
                    out.append(text(ref[1:-1], seen + (key,)))
                else:
                    out.append(line)
            done[key] = "".join(out).strip("\n") + "\n"
        return done[key]

    return {key: text(key) for key in raw}


_MODULES: dict = {}  # (source, options, device id) -> {name: function}, or None: no compile
_LOCK = threading.Lock()  # guards _KEY_LOCKS and _GENERATION
_KEY_LOCKS: dict = {}  # a lock per key: one compile per module and device, others side by side
_GENERATION = [0]  # bumped by clear_cache: each CudaModule's own per-device copies go stale
_MISS = object()


def clear_cache() -> None:
    """Forget every compiled module (and every recorded failure): the next ``get`` compiles
    again (tests that swap CuPy for a stand-in)."""
    with _LOCK:
        _MODULES.clear()
        _GENERATION[0] += 1
    elementwise.cache_clear()


class CudaModule:
    """A kernel source of ``files`` (in the folder of ``module_file``, a module's
    ``__file__``) and the kernels it names, compiled per device on first use (module
    docstring)."""

    def __init__(self, module_file: str, *files: str, names, options=(), table: bool = False,
                 prelude: str = "", fallback: str | None = None):  # fmt: skip
        self.folder = os.path.dirname(os.path.abspath(module_file))
        self.files = tuple(files)
        self.names = tuple(names)
        self.options = tuple(options)
        self.table = bool(table)
        self.prelude = prelude
        self.fallback = fallback
        self._warned = False
        self._mine = (-1, {})  # (generation, {device id: the cache's entry}): a launch's lookup

    @property
    def paths(self) -> tuple:
        """The module's ``.cu`` files (full paths), in order."""
        return tuple(os.path.join(self.folder, f) for f in self.files)

    @property
    def source(self) -> str:
        """The text compiled (read on first use, then the same string)."""
        return read_source(self.folder, self.files, self.prelude, self.table)

    def get(self, device_id: int):
        """``{name: function}`` on ``device_id``: compiled there on first use, then cached. A
        source that does not compile: None with a ``fallback`` (warned once), else the error."""
        gen, mine = self._mine
        hit = mine.get(device_id, _MISS)
        if hit is not _MISS and gen == _GENERATION[0]:
            return hit
        key = (self.source, self.options, int(device_id))
        with _LOCK:
            lock = _KEY_LOCKS.setdefault(key, threading.Lock())
            gen = _GENERATION[0]
        with lock:
            hit = _MODULES.get(key, _MISS)
            if hit is _MISS:
                hit = self._compile(key)
                _MODULES[key] = hit
        if self._mine[0] != gen:
            self._mine = (gen, {})
        self._mine[1][device_id] = hit
        return hit

    def _compile(self, key):
        source, options, device_id = key
        try:
            import cupy

            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(code=source, options=options)
                return {name: mod.get_function(name) for name in self.names}
        except Exception as e:  # noqa: BLE001 - any compile / load failure: see fallback
            if self.fallback is None:
                raise
            if not self._warned:
                self._warned = True
                log.warning("avpipe: %s kernels failed to compile (%s: %s); using the slower "
                            "array-module path", self.fallback, type(e).__name__, e)  # fmt: skip
            return None


@functools.cache
def elementwise(in_params: str, out_params: str, body: str, name: str):
    """``cupy.ElementwiseKernel(in_params, out_params, body, name)``, made once (CuPy compiles
    it per device at its first launch there, and caches that)."""
    import cupy

    return cupy.ElementwiseKernel(in_params, out_params, body, name)


# --- small per-call tables in a launch's own parameters -----------------------------------------
#
# A kernel's per-call table (a batch's rows, boxes, jitter factors: a few hundred bytes) can
# travel in the launch's parameters instead of a host -> device copy: no pinned buffer, no
# device buffer, no event to keep them alive (the driver takes the parameters' bytes at the
# launch): the host spends a fraction of the time of an upload_many and a launch
# (docs/how-it-works.md, "Measured trade-offs"). A kernel takes the table as ``AvpTable`` by
# value (CUDA's ``__grid_constant__``: read in place, not copied per thread) beside its pointer
# arguments, and an ``inl`` flag: set, its table pointers are byte offsets into that table
# (``avp_tab``); offset 0 is never one (the first word is left empty), so a null pointer still
# means "none". The table is TABLE_BYTES: with a kernel's other arguments within the 4 KiB of
# parameters every CUDA device takes; 3,584 bytes of arrays (a batch of 64 rows of 7 int64).
# Larger tables, and GPUs before compute capability 7.0 (no ``__grid_constant__``), keep the
# copy.

TABLE_BYTES = 3592
TABLE_CUDA = _read(_HERE, "launch_table.cuh").replace("@WORDS@", str(TABLE_BYTES // 8))
_TABLE = np.dtype({"names": ["w"], "formats": [(np.int64, (TABLE_BYTES // 8,))]}, align=True)
NO_TABLE = np.zeros(TABLE_BYTES // 8, np.int64).view(_TABLE)[0]  # the table of a launch without


def launch_table(xp, arrays):
    """Host ``arrays`` packed into one by-value kernel argument (``AvpTable``), each at an
    offset aligned to 8 bytes (from 8 on): ``(table, offsets)`` with the offsets as
    ``numpy.uint64`` (what the kernel's pointer arguments take in their place), or None where
    they do not fit ``TABLE_BYTES`` or the current device cannot read a table so (then copy
    them up: :func:`upload_many`)."""
    if xp is np or not _tables_ok(xp, xp.cuda.Device().id):
        return None
    offs, pos = [], 8
    for a in arrays:
        offs.append(np.uint64(pos))
        pos += -(-a.nbytes // 8) * 8
    if pos > TABLE_BYTES:
        return None
    w = np.zeros(TABLE_BYTES // 8, np.int64)
    raw = w.view(np.uint8)
    for a, o in zip(arrays, offs):
        o = int(o)
        raw[o : o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    return w.view(_TABLE)[0], offs


def table_args(xp, arrays):
    """Host ``arrays`` for a kernel that takes a launch table: ``(tab, inl, args)``, the
    arrays in the launch's own table where they fit (``args`` their byte offsets, ``inl`` 1),
    else copied up in one copy (``args`` device arrays, ``inl`` 0, ``tab`` :data:`NO_TABLE`)."""
    got = launch_table(xp, arrays)
    if got is None:
        return NO_TABLE, 0, transfers.upload_many(xp, arrays)
    return got[0], 1, got[1]


@functools.cache
def _tables_ok(xp, device_id: int) -> bool:
    """Whether kernels on ``device_id`` read a launch's table in place (compute capability 7.0
    or later: ``__grid_constant__``)."""
    try:
        return int(xp.cuda.Device(device_id).compute_capability) >= 70
    except Exception:  # noqa: BLE001 - no capability known: keep the copies
        return False
