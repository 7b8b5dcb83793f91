"""Image decoding in a helper process (private), for inputs no header check can vouch for.

A native decoder that dies on an input (a signal: SIGFPE, SIGSEGV; an abort) takes the whole
process with it, and no Python ``try`` catches that. The inputs avpipe cannot check up front
(``AVPIPE_IMAGE_ISOLATION``: JPEG 2000 whose main header the check could not walk to its end,
or every image with ``all``) are decoded here instead: one long-lived helper process (a fresh
interpreter running :func:`_serve`; started on first use, about a
second for its imports) decodes them one at a time with the same CPU decoder (DALI), and sends
the pixels or the typed error back. When it dies, the image it was on gets a
:class:`~avpipe.errors.CorruptDataError` naming the file and the signal, and the next image
starts a new helper; when it takes longer than :data:`TIMEOUT_S`, it is killed and the image
gets a :class:`~avpipe.errors.DecodeTimeoutError`.

Protocol (both ways): an 8-byte little-endian length, then a pickle. Request: ``(name, data,
roi, fancy)``; reply: ``("ok", array)`` or ``("err", DecodeError)``. The helper's stdout carries
only the protocol (its fd 1 goes to stderr, which is discarded: the native decoders' lines
are in each error's message).
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from ...errors import CorruptDataError, DecodeError, DecodeTimeoutError
from ._cpu import decode_alone

TIMEOUT_S = 120.0  # one image (the first one also waits for the helper's imports)

_LOCK = threading.Lock()
_STATE: dict = {"proc": None}


def _package_root() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))


def _start():
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen(
        [sys.executable, "-c", "from avpipe.decoding.image._isolated import _serve; _serve()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        close_fds=True,
    )  # fmt: skip


def _stop(proc) -> None:
    if proc is None:
        return
    try:
        proc.kill()
    except OSError:
        pass
    try:
        proc.wait(5)
    except Exception:  # noqa: BLE001 - exiting
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except Exception:  # noqa: BLE001
            pass


_LEFT: list = []  # a forked child's copy of its parent's helper: the parent's, never used here


def _after_fork_in_child() -> None:
    """A forked child shares its parent's pipes to the helper: it starts its own when needed
    (and never kills the parent's at its exit)."""
    global _LOCK
    _LOCK = threading.Lock()
    if _STATE["proc"] is not None:
        _LEFT.append(_STATE["proc"])
        _STATE["proc"] = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _at_exit() -> None:
    with _LOCK:
        proc, _STATE["proc"] = _STATE["proc"], None
    _stop(proc)


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``fd``; None at end of file; raises TimeoutError past ``deadline``."""
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            raise TimeoutError
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _signal_name(rc) -> str:
    if rc is None:
        return "it stopped answering"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def decode(name: str, data: bytes, roi, fancy: bool, what: str = "image decoder"):
    """Decode one image in the helper process: ``(array, None)`` or ``(None, DecodeError)``."""
    msg = pickle.dumps((name, bytes(data), roi, bool(fancy)), protocol=pickle.HIGHEST_PROTOCOL)
    with _LOCK:
        proc = _STATE["proc"]
        if proc is None or proc.poll() is not None:
            _stop(proc)
            _STATE["proc"] = None
            try:
                proc = _STATE["proc"] = _start()
            except OSError as e:  # no interpreter to start (an embedded Python): not decoded
                return None, DecodeError(
                    name, f"not decoded: the {what} runs in a helper process for this file, "
                    f"and none could start ({type(e).__name__}: {e})")  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        try:
            proc.stdin.write(struct.pack("<Q", len(msg)) + msg)
            proc.stdin.flush()
            fd = proc.stdout.fileno()
            head = _read_exact(fd, 8, deadline)
            body = None if head is None else _read_exact(fd, struct.unpack("<Q", head)[0], deadline)
        except TimeoutError:
            _STATE["proc"] = None
            _stop(proc)
            return None, DecodeTimeoutError(
                name, f"the {what} did not finish within {TIMEOUT_S:g} s (an isolated "
                "helper process, killed)")  # fmt: skip
        except (BrokenPipeError, OSError):
            body = None
        if body is None:  # the helper died on this image
            _STATE["proc"] = None
            try:
                rc = proc.wait(5)
            except subprocess.TimeoutExpired:
                rc = None
            _stop(proc)
            return None, CorruptDataError(
                name, f"the {what} crashed on it ({_signal_name(rc)}, in an isolated "
                "helper process: only this file is lost)")  # fmt: skip
    kind, value = pickle.loads(body)
    if kind == "ok":
        return value, None
    if isinstance(value, DecodeError):
        return None, value
    return None, CorruptDataError(name, f"the {what} failed on it ({value})")


def _serve() -> None:
    """The helper's loop: requests from stdin, replies to the protocol's copy of stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # native decoders' prints never mix with the protocol
    inp = sys.stdin.buffer

    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        body = inp.read(struct.unpack("<Q", head)[0])
        name, data, roi, fancy = pickle.loads(body)
        try:
            img, err = decode_alone(name, data, roi, fancy)
            reply = ("ok", img) if err is None else ("err", err)
        except Exception as e:  # noqa: BLE001 - reported to the parent, typed there
            reply = ("err", f"{type(e).__name__}: {e}")
        msg = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(struct.pack("<Q", len(msg)) + msg)
        out.flush()

