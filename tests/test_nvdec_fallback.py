"""What happens when NVDEC or the packet path gives up (no GPU needed: stand-ins for the GPU
parts)."""

from __future__ import annotations

import numpy as np
import pytest
from video_media import make_video

import avpipe
from avpipe.decoding.video import _nvdec as nv
from avpipe.errors import UnsupportedFormatError


class _Gpu:
    closed = False

    def close(self):
        self.closed = True


@pytest.fixture()
def video(tmp_path):
    return make_video(tmp_path / "r.mp4", codec="h264", num_frames=20)


@pytest.mark.parametrize("allow", [True, False])
def test_a_refusal_at_the_first_request_is_a_refusal(video, allow):
    """NVDEC refusing a stream only when it sees it (size limits) acts like a refusal at open:
    the CPU decodes from then on and says why, or the caller gets UnsupportedFormatError."""
    with avpipe.VideoDecoder(video, device="cpu") as ref:
        want = ref.get_frames([3, 1, 3]).data
    d = avpipe.VideoDecoder(video, device="cpu", allow_cpu_fallback=allow)
    gpu = d._gpu = _Gpu()  # as if NVDEC had accepted the stream at open

    def refuse(*a):
        raise nv.NvdecRefused("PyNvVideoCodec could not open r.mp4: size over the limit")

    d._decode_gpu = refuse
    if not allow:
        with pytest.raises(UnsupportedFormatError, match="size over the limit") as e:
            d.get_frames([3, 1, 3])
        assert "r.mp4" in str(e.value)
        return
    got = d.get_frames([3, 1, 3])
    np.testing.assert_array_equal(got.data, want)
    assert gpu.closed and d._gpu is None and d.backend == "pyav"
    assert "size over the limit" in d.fallback_reason
    np.testing.assert_array_equal(d.get_frames([1]).data[0], want[1])  # and it stays on the CPU
    d.close()


def test_packet_path_failures_turn_it_off_only_in_a_row(monkeypatch):
    """One file on which PyNvVideoCodec misbehaves costs that file the packet path; three in a
    row (with no success between) turn it off for the process."""
    monkeypatch.setattr(nv, "_packet_path", {"enabled": True, "why_off": None, "failures": 0})
    nv._packet_path_failed("a.mp4", "RuntimeError: odd")
    nv._packet_path_failed("b.mp4", "RuntimeError: odd")
    assert nv._packet_path["enabled"]
    nv._packet_path["failures"] = 0  # what a served request does
    nv._packet_path_failed("c.mp4", "RuntimeError: odd")
    nv._packet_path_failed("d.mp4", "RuntimeError: odd")
    assert nv._packet_path["enabled"]
    nv._packet_path_failed("e.mp4", "RuntimeError: odder")
    assert not nv._packet_path["enabled"]
    assert nv._packet_path["why_off"] == "RuntimeError: odder"


def test_backends_implement_one_interface_and_never_call_the_front(video):
    """PyAV and NVDEC implement VideoBackend; VideoDecoder alone decides on the fallback: no
    backend takes a callback into it or imports it."""
    import ast
    import inspect
    import pathlib

    from avpipe.decoding.video import _pyav
    from avpipe.decoding.video._backend import BackendRefused, VideoBackend

    with avpipe.VideoDecoder(video, device="cpu") as d:
        assert isinstance(d._cpu, VideoBackend)
        shape = (d.metadata.height, d.metadata.width, 3)
        out = np.zeros((3, *shape), np.uint8)
        assert d._cpu.decode([1, 3], output="rgb", chw=False, out=out, slots=[[0, 2], [1]]) == []
        want = d.get_frames([1, 3, 1]).data
        np.testing.assert_array_equal(out, want)
    assert issubclass(nv.NvdecRefused, BackendRefused)
    params = inspect.signature(nv.NvdecBackend.decode).parameters
    assert list(params) == ["self", "targets", "output", "chw", "out", "slots"]
    for mod in (_pyav, nv):
        tree = ast.parse(pathlib.Path(mod.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.level == 1 and node.module is None), mod.__name__
                assert node.module != "avpipe.decoding.video", mod.__name__


class _FakeCupy:
    """Just enough of cupy, backed by numpy, to run VideoDecoder's GPU-side code on the CPU."""

    uint8 = np.uint8
    empty = staticmethod(np.empty)
    asarray = staticmethod(np.asarray)
    rot90 = staticmethod(np.rot90)
    moveaxis = staticmethod(np.moveaxis)
    ascontiguousarray = staticmethod(np.ascontiguousarray)

    class cuda:  # noqa: N801
        @staticmethod
        def Device(i):  # noqa: N802
            import contextlib

            return contextlib.nullcontext()


class _HalfNvdec:
    """A backend that delivers every other target (from the CPU reference) and returns the rest
    as not delivered, as NVDEC does for frames whose numbering differs from the scan."""

    name = "nvdec"

    def __init__(self, ref):
        self.ref = ref

    def decode(self, targets, *, output, chw, out, slots):
        missing = []
        for k, (t, rows) in enumerate(zip(targets, slots)):
            if k % 2:
                missing.append(t)
                continue
            a = self.ref[t]
            a = np.moveaxis(a, -1, 0) if chw else a
            for r in rows:
                out[r] = a
        return missing

    def close(self):
        pass


@pytest.mark.parametrize("layout", ["HWC", "CHW"])
def test_frames_nvdec_did_not_deliver_come_from_pyav(video, monkeypatch, layout):
    import sys

    from avpipe.device import Device

    with avpipe.VideoDecoder(video, device="cpu") as ref:
        frames = {i: ref.get_frames([i]).data[0] for i in range(20)}
        want = ref.get_frames([5, 2, 9, 2, 14]).data
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    d = avpipe.VideoDecoder(video, device="cpu", layout=layout)
    d.device = Device("cuda", 0)
    d._gpu = _HalfNvdec(frames)
    got = d.get_frames([5, 2, 9, 2, 14])
    np.testing.assert_array_equal(got.data, want if layout == "HWC" else np.moveaxis(want, -1, 1))
    assert d.backend == "nvdec"
    d.close()
