"""nvImageCodec's decoder, called directly (private): the GPU path of ``decode_image_batch``.

DALI's ``"mixed"`` image decoder is nvImageCodec inside a DALI pipeline, and a DALI pipeline is
invalid after any operator error: every bad image costs a rebuild (seconds, most of it the decoders'
set-up; figures: docs/how-it-works.md, "Measured trade-offs"). nvImageCodec's own ``Decoder.decode``
returns ``None`` for an image it cannot decode and stays usable, so a bad image costs one failed
decode, nothing more. The decoder is the same library DALI runs (a DALI dependency: no new package),
built once per (GPU, chroma rule, hardware share) with the same settings as DALI's mixed decoder:
the hardware JPEG decoder takes ``AVPIPE_JPEG_HW_LOAD`` of each batch, then the CUDA, hybrid and CPU
decoders; ``fancy_upsampling`` makes JPEG chroma match libjpeg-turbo (the CPU path).

A box (``roi``) is cut from the decoded, upright picture: nvImageCodec's regions are in the
stored picture's coordinates, before the EXIF rotation.
"""

from __future__ import annotations

import threading

from ._dali import native_call, num_threads

_CACHE: dict = {}
_LOCK = threading.Lock()


class Decoder:
    """One nvImageCodec decoder on one GPU; ``decode`` is serialised (one batch at a time)."""

    def __init__(self, device_index: int, fancy: bool, hw_load: float):
        try:
            from nvidia import nvimgcodec as nv
        except ImportError as e:
            raise ImportError(
                "decoding images on a GPU needs nvImageCodec (the package nvidia-nvimgcodec, "
                f"installed with nvidia-dali-cuda120), which does not import here: {e}; "
                "decode on the CPU with device='cpu'") from e

        self.nv = nv
        self.lock = threading.Lock()
        backends = [
            nv.Backend(nv.HW_GPU_ONLY, load_hint=hw_load),
            nv.Backend(nv.GPU_ONLY),
            nv.Backend(nv.HYBRID_CPU_GPU),
            nv.Backend(nv.CPU_ONLY),
        ]
        self.dec = nv.Decoder(
            device_id=device_index,
            max_num_cpu_threads=num_threads(),  # as DALI's pipelines
            backends=backends,
            options=":fancy_upsampling=1" if fancy else "",
        )
        self.params = nv.DecodeParams(
            apply_exif_orientation=True,
            color_spec=nv.SRGB,
            allow_any_depth=False,  # 8 bits: 16-bit samples scaled to uint8
            sample_format=nv.I_RGB,
        )

    def code_stream(self, data):
        """The parsed stream of ``data`` (bytes or a uint8 array); raises where it cannot parse."""
        return self.nv.CodeStream(data)

    def decode(self, streams: list, cuda_stream: int) -> list:
        """Decode the parsed streams on ``cuda_stream``: one Image or None (failed) per stream.
        Inside ``_dali.native_call`` (its CPU threads; interpreter exit waits for it)."""
        with native_call(), self.lock:
            return list(self.dec.decode(streams, params=self.params, cuda_stream=cuda_stream))


def get(device_index: int, fancy: bool, hw_load: float) -> Decoder:
    """The cached decoder. The cache keeps each one to the end: it is never the last reference
    that a feed's daemon thread drops (its threads are joined at module teardown, on the
    exiting thread)."""
    key = (device_index, bool(fancy), float(hw_load))
    with _LOCK:
        dec = _CACHE.get(key)
        if dec is None:
            with native_call():
                dec = _CACHE[key] = Decoder(device_index, fancy, hw_load)
        return dec


def to_cupy(img):
    """An nvImageCodec Image -> a cupy view of it (its buffer stays the Image's: cupy keeps the
    Image alive), ``[H, W, 3]``: one channel is repeated, a fourth (alpha) dropped."""
    import cupy
    import numpy as np

    if str(img.buffer_kind).endswith("STRIDED_HOST"):  # a CPU decoder's output
        a = cupy.asarray(np.asarray(img))
    else:
        a = cupy.asarray(img)
    if a.ndim == 2:
        a = a[:, :, None]
    if a.shape[2] in (1, 2):  # gray (with alpha)
        a = cupy.broadcast_to(a[:, :, :1], (*a.shape[:2], 3))
    elif a.shape[2] > 3:  # alpha
        a = a[:, :, :3]
    return a
