"""Images decoded on the CPU by DALI, a chunk at a time (private): the decode itself, the
native decoders' stderr kept off the user's, and a sentence for what a failure means. Both the
package's :func:`~avpipe.decoding.image.decode_image_batch` and the helper process that decodes
unverifiable images alone (:mod:`._isolated`) decode through it."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading

import numpy as np

from ... import settings
from ...device import Device, resolve_device
from ...errors import CorruptDataError, DecodeError, UnsupportedFormatError
from . import _dali
from ._header import FORMAT_NAMES, sniff_format

MAX_BATCH = 256

_TRUNCATED = ("end of stream", "unexpected end", "too short", "truncat", "read error",
              "premature", "not enough data", "incomplete", "end of file", "eof")  # fmt: skip

_QUIET_LOCK = threading.Lock()
_QUIET = {"depth": 0, "saved": -1, "file": None}


@contextlib.contextmanager
def native_stderr():
    """Keep the native decoders' own lines (nvImageCodec's ``[ERROR] [png_parser] ...``, libtiff,
    OpenCV) off the user's stderr: file descriptor 2 goes to a temporary file while DALI runs
    (no DALI / nvImageCodec setting silences them). Yields a list that receives the captured
    text when the outermost block ends; it goes into the error's message instead.
    ``AVPIPE_NATIVE_STDERR=1`` leaves stderr alone."""
    out: list = []
    active = not settings.native_stderr()
    with _QUIET_LOCK:
        if active and _QUIET["depth"] == 0:
            try:
                sys.stderr.flush()
            except Exception:  # noqa: BLE001
                pass
            try:
                f = tempfile.TemporaryFile()
                _QUIET["saved"], _QUIET["file"] = os.dup(2), f
                os.dup2(f.fileno(), 2)
            except OSError:  # no fd 2 (a daemon) or no temporary folder: leave stderr alone
                active = False
        if active:
            _QUIET["depth"] += 1
    if not active:
        yield out
        return
    try:
        yield out
    finally:
        with _QUIET_LOCK:
            _QUIET["depth"] -= 1
            if _QUIET["depth"] == 0:
                os.dup2(_QUIET["saved"], 2)
                os.close(_QUIET["saved"])
                f = _QUIET["file"]
                f.seek(0)
                text = f.read(1 << 16).decode("utf-8", "replace")
                f.close()
                out.append(re.sub(r"\x1b\[[0-9;]*m", "", text).strip())


def _classify(name: str, data: bytes, exc: BaseException) -> DecodeError:
    """A sentence about what is wrong with the file, with the native detail after it."""
    text = str(exc)
    m = re.search(r"encountered:\s*(.*)", text, re.S)
    why = (m.group(1) if m else text).strip().splitlines()
    why = why[0].strip() if why else type(exc).__name__
    fmt = sniff_format(data)
    if fmt is None:
        return UnsupportedFormatError(name, f"not a supported image format ({why})")
    native = [re.sub(r"^(\[[^\]]*\]\s*)+", "", ln.strip())
              for ln in getattr(exc, "native_log", "").splitlines() if ln.strip()]  # fmt: skip
    if why.startswith("Failed to decode sample") and native:
        why = native[0]
    detail = "; ".join(dict.fromkeys([*native[:2], why]))
    what = FORMAT_NAMES.get(fmt, fmt)
    low = (text + " " + " ".join(native)).lower()
    if any(k in low for k in _TRUNCATED):
        return CorruptDataError(name, f"the {what} data ends early (truncated) [{detail}]")
    return CorruptDataError(name, f"the {what} data is corrupt: the decoder refused it [{detail}]")


def _run(dev: Device, encoded: list, rois, fancy: bool = True):
    """Decode one chunk on the CPU (DALI); returns (list of arrays, None). Raises DALI's error."""
    use_roi = rois is not None
    cap = _dali.capacity_for(len(encoded), MAX_BATCH)
    dec = _dali.get(None, cap, use_roi, fancy)
    # the copy out of DALI's buffers too: the exit hook shuts the pipeline down only after it
    with _dali.native_call():
        try:
            with native_stderr() as log:
                try:
                    out = dec.run(encoded, rois)
                except _dali.ShuttingDown:  # the interpreter is exiting; the pipeline is fine
                    raise
                except BaseException:
                    _dali.discard(dec)
                    raise
        except Exception as e:
            try:
                e.native_log = log[0] if log else ""
            except AttributeError:
                pass
            raise
        return _dali.to_host_list(out), None


def decode_alone(name: str, data: bytes, roi, fancy: bool):
    """One image on the CPU (DALI), as the helper process decodes it: ``(array, None)`` or
    ``(None, DecodeError)``."""
    dev = resolve_device("cpu")
    with dev.activate():
        try:
            items, _ = _run(dev, [np.frombuffer(data, np.uint8)], None if roi is None else [roi],
                            fancy)  # fmt: skip
            return items[0], None
        except _dali.ShuttingDown:
            raise
        except Exception as e:  # noqa: BLE001 - DALI raises RuntimeError
            return None, _classify(name, data, e)
