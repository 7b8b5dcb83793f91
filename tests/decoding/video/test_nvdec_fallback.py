"""What happens when NVDEC or the packet path gives up (no GPU needed: stand-ins for the GPU
parts)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from paths import SAMPLES
from video_media import make_video

import avpipe
from avpipe.decoding.video import _nvdec as nv
from avpipe.errors import UnsupportedFormatError


class _RefusesAtFirstRequest:
    """A backend that opens, then refuses the stream at its first request, as NVDEC does for
    limits it only reports once it sees the stream."""

    name = "late"
    on_gpu = False
    damaged = None
    closed = False

    def decode(self, targets, *, output, chw, out, slots):
        raise nv.NvdecRefused("PyNvVideoCodec could not open r.mp4: size over the limit")

    def close(self):
        self.closed = True


class _LateEntry:
    name = "late"
    label = "NVDEC"

    def __init__(self):
        self.opened = []

    def accepts(self, req):
        return True

    def open(self, req):
        self.opened.append(_RefusesAtFirstRequest())
        return self.opened[-1]


@pytest.fixture()
def video(tmp_path):
    return make_video(tmp_path / "r.mp4", codec="h264", num_frames=20)


@pytest.mark.parametrize("allow", [True, False])
def test_a_refusal_at_the_first_request_is_a_refusal(video, allow):
    """A backend refusing a stream only when it sees it (NVDEC's size limits) acts like a
    refusal at open: the next backend (PyAV) decodes from then on and says why, or, on a GPU
    without ``allow_cpu_fallback``, the caller gets UnsupportedFormatError."""
    import dataclasses

    from avpipe.decoding.backends import registered
    from avpipe.device import Device

    with avpipe.VideoDecoder(video, device="cpu") as ref:
        want = ref.get_frames([3, 1, 3]).data
    entry = _LateEntry()
    with registered("video", entry, before="pyav"):
        d = avpipe.VideoDecoder(video, device="cpu", allow_cpu_fallback=allow)
    assert d.backend == "late" and d.fallbacks == []
    if not allow:  # PyAV on a GPU device only with allow_cpu_fallback
        d._request = dataclasses.replace(d._request, device=Device("cuda", 0))
        with pytest.raises(UnsupportedFormatError, match="NVDEC refused the stream: .*size over"
                           ) as e:  # fmt: skip
            d.get_frames([3, 1, 3])
        assert "r.mp4" in str(e.value)
        return
    got = d.get_frames([3, 1, 3])
    np.testing.assert_array_equal(got.data, want)
    assert entry.opened[0].closed and d._gpu is None and d.backend == "pyav"
    assert "size over the limit" in d.fallback_reason
    assert [f.backend for f in d.fallbacks] == ["late"]
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
    on_gpu = True

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


class _Stream:
    def __init__(self, log=None):
        self.log = [] if log is None else log

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def synchronize(self):
        self.log.append("sync")


class _OrderedPackets:
    """A packet decoder whose display-order sessions hand out too few pictures on ``bad``
    files; decode order works, except on ``short`` files, where it yields the first target
    only."""

    def __init__(self, bad, short=()):
        self.bad, self.short, self.calls, self.log = bad, set(short), [], []

    def frames(self, path, scan, targets, *, in_display_order=True):
        self.calls.append((path, in_display_order))
        self.log.append(("frames", in_display_order))
        if in_display_order and path in self.bad:  # every target out, then the count fails
            for t in targets:
                yield t, ("frame", t, in_display_order)
            raise nv.DisplayOrderError("40 packets gave 38 pictures")
        for t in targets[: 1 if path in self.short else None]:  # short: the first target only
            yield t, ("frame", t, in_display_order)


def _packet_backend(path, monkeypatch, pd):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    monkeypatch.setattr(nv, "thread_packet_decoder", lambda gpu, stream: pd)
    b = object.__new__(nv.NvdecBackend)
    b.scan = types.SimpleNamespace(source_name=path)
    b.device = types.SimpleNamespace(index=0)
    b._source = types.SimpleNamespace(path=path)
    b._stream, b._stream_ptr = _Stream(pd.log), 0
    b.packet_path, b._packet_failure = True, None  # _display_order: the class's default
    b.written = []
    b._write = lambda frame, rows, output, chw, out: b.written.append((frame, rows))
    return b


def test_a_file_display_order_fails_on_goes_in_decode_order(monkeypatch):
    """The packet path asks for display order (native latency); a file on which that session's
    pictures do not add up is served in decode order, that request and every later one, with
    every target written from the decode-order pass; other files keep display order."""
    pd = _OrderedPackets(bad={"cra.mp4"})
    monkeypatch.setattr(nv, "_packet_path", {"enabled": True, "why_off": None, "failures": 0})
    bad = _packet_backend("cra.mp4", monkeypatch, pd)
    targets, slots = [3, 7, 11], [[0], [1], [2, 3]]
    assert bad._decode_packets(targets, "rgb", False, None, slots) == []
    assert pd.calls == [("cra.mp4", True), ("cra.mp4", False)]
    # the dropped session's frames are read (the stream synchronized) before the retry
    assert pd.log[:3] == [("frames", True), "sync", ("frames", False)]
    assert bad.packet_path and not bad._display_order
    last = {rows[0]: frame for frame, rows in bad.written}  # the retry wrote every target again
    assert [last[r][2] for r in (0, 1, 2)] == [False, False, False]
    assert bad._packet_failure is None  # served: nothing counts against the packet path
    assert bad._decode_packets([5], "rgb", False, None, [[0]]) == []
    assert pd.calls[-1] == ("cra.mp4", False)  # no second try in display order
    good = _packet_backend("ok.mp4", monkeypatch, pd)
    assert good._decode_packets(targets, "rgb", False, None, slots) == []
    assert pd.calls[-1] == ("ok.mp4", True) and good._display_order
    assert good._packet_failure is None


def test_a_decode_order_retry_short_of_targets_is_not_served(monkeypatch):
    """Frames written by the failed display-order pass do not count: the retry must deliver
    every target itself, else the request leaves the packet path."""
    pd = _OrderedPackets(bad={"cra.mp4"}, short={"cra.mp4"})
    b = _packet_backend("cra.mp4", monkeypatch, pd)
    assert b._decode_packets([3, 7, 11], "rgb", False, None, [[0], [1], [2]]) is None
    assert not b.packet_path and b._packet_failure == "delivered 1 of 3 frames"


def test_decode_order_failing_too_leaves_the_packet_path_for_the_file(monkeypatch):
    class Never(_OrderedPackets):
        def frames(self, path, scan, targets, *, in_display_order=True):
            self.calls.append((path, in_display_order))
            if in_display_order:
                raise nv.DisplayOrderError("packets gave 0 pictures")
            raise nv.PacketPathError("packets gave 0 pictures")
            yield  # pragma: no cover

    pd = Never(bad=set())
    b = _packet_backend("x.mp4", monkeypatch, pd)
    assert b._decode_packets([1], "rgb", False, None, [[0]]) is None
    assert pd.calls == [("x.mp4", True), ("x.mp4", False)] and not b.packet_path


def test_other_packet_path_refusals_are_not_retried(monkeypatch):
    """A refusal that is not about display order (a short file, the demuxer's order) leaves the
    packet path for the file at once, with no decode-order pass."""

    class Refuses(_OrderedPackets):
        def frames(self, path, scan, targets, *, in_display_order=True):
            self.calls.append((path, in_display_order))
            raise nv.PacketPathError("the file is shorter than its packet index")
            yield  # pragma: no cover

    pd = Refuses(bad=set())
    b = _packet_backend("x.mp4", monkeypatch, pd)
    assert b._decode_packets([1], "rgb", False, None, [[0]]) is None
    assert pd.calls == [("x.mp4", True)] and not b.packet_path and b._display_order


# --- the SimpleDecoder path's label check (FrameLabels) ---

_PTS = np.arange(30, dtype=np.int64) * 512  # display order, frame i at 512 i
_DTS = _PTS - 2 * 512  # B-frames, a reorder delay of two: the i-th decode time is frame i-2's pts


class _Simple:
    """A SimpleDecoder stand-in: labels frames by ``convention`` ("pts" or "dts") and hands out
    frame ``wrong[i]`` where ``i`` is asked for (labelled as that frame)."""

    def __init__(self, convention, wrong=None, label0=None):
        self.convention, self.wrong, self.label0, self.asked = convention, wrong or {}, label0, []

    def get_batch_frames_by_index(self, idx):
        import types

        self.asked.append(list(idx))
        out = []
        for i in idx:
            j = self.wrong.get(i, i)
            label = int((_PTS if self.convention == "pts" else _DTS)[j])
            if j == 0 and self.label0 is not None:
                label = self.label0
            out.append(types.SimpleNamespace(pts=label, index=j))
        return out


def _simple_backend(monkeypatch, dec, dts=_DTS, path=None):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    b = object.__new__(nv.NvdecBackend)
    b.scan = types.SimpleNamespace(source_name="b_frames.mp4", codec="hevc", pts=_PTS,
                                   dts_sorted=dts, stream_index=0, decode_pts=None)
    b.device = types.SimpleNamespace(index=0)
    b._source = types.SimpleNamespace(path=None if path is None else str(path))
    b._stream, b.packet_path, b._packet_failure = _Stream(), False, None
    b._pts_offset, b._labels, b.pts_mismatches = None, None, 0
    b._simple = lambda: dec
    b.written = []
    b._write = lambda frame, rows, output, chw, out: b.written.append((frame.index, rows))
    return b


def _serve(b, targets):
    slots = [[k] for k in range(len(targets))]
    return b.decode(targets, output="rgb", chw=False, out=None, slots=slots)


@pytest.mark.parametrize("convention", ["pts", "dts"])
def test_a_wrong_picture_labelled_under_the_other_convention_is_not_taken(monkeypatch, convention):
    """A wrong picture whose label is frame i's under the other convention (pts labels: frame i-2
    for frame i, its pts being the i-th decode time; decode-time labels: frame i+2, whose decode
    time is frame i's pts) goes to the CPU once frame 0's label has fixed the file's convention;
    frame 0, asked for only to read its label, is neither written nor reported missing."""
    step = -2 if convention == "pts" else 2
    wrong = {13: 13 + step, 14: 14 + step, 22: 22 + step}
    dec = _Simple(convention, wrong)
    b = _simple_backend(monkeypatch, dec)
    assert _serve(b, [10, 12, 13, 14, 16]) == [13, 14]
    assert dec.asked == [[0, 10, 12, 13, 14, 16]]
    assert b.written == [(10, [0]), (12, [1]), (16, [4])]
    assert b._labels.fixed == {"pts": ("pts", "zero"), "dts": ("dts",)}[convention]
    b.written.clear()
    assert _serve(b, [20, 22]) == [22]  # the convention stays fixed: no frame 0 again
    assert dec.asked[-1] == [20, 22] and b.written == [(20, [0])]
    assert b.pts_mismatches == 3


def test_what_frame_0_said_is_kept_per_file(monkeypatch, tmp_path):
    """A later open of the same file skips frame 0; a changed file (size, mtime) asks again."""
    p = tmp_path / "v.mp4"
    p.write_bytes(b"x")
    first = _Simple("dts")
    _serve(_simple_backend(monkeypatch, first, path=p), [5])
    again = _Simple("dts", {7: 9})
    b = _simple_backend(monkeypatch, again, path=p)
    assert _serve(b, [7]) == [7] and again.asked == [[7]] and b._labels.fixed == ("dts",)
    p.write_bytes(b"xy")
    changed = _Simple("pts")
    _serve(_simple_backend(monkeypatch, changed, path=p), [5])
    assert changed.asked == [[0, 5]]


def test_a_request_starting_at_frame_0_fixes_the_convention_itself(monkeypatch):
    dec = _Simple("dts", {14: 12})
    b = _simple_backend(monkeypatch, dec)
    assert _serve(b, [0, 4, 14]) == [14]
    assert dec.asked == [[0, 4, 14]] and b.written == [(0, [0]), (4, [1])]
    assert b._labels.fixed == ("dts",)


def test_without_reordering_no_frame_0_is_asked_for(monkeypatch):
    """Where decode times equal the pts (no B-frames) every convention names the same frame."""
    dec = _Simple("pts", {9: 7})
    b = _simple_backend(monkeypatch, dec, dts=_PTS)
    assert _serve(b, [5, 9]) == [9]
    assert dec.asked == [[5, 9]] and b._labels.fixed is None


def test_a_frame_0_label_under_no_convention_keeps_every_one(monkeypatch):
    """Frame 0 labelled with something no convention gives: nothing is fixed (frames are checked
    against every convention, as before) and frame 0 is not asked for again."""
    dec = _Simple("dts", label0=12345)
    b = _simple_backend(monkeypatch, dec)
    assert _serve(b, [3, 5]) == []
    assert _serve(b, [7]) == []
    assert dec.asked == [[0, 3, 5], [7]] and b._labels.fixed is None and b._labels.tried


# --- streams the SimpleDecoder path serves wrongly (open GOPs) ---

_SAMPLES = os.path.join(SAMPLES, "video")


def _scan_of(path):
    with avpipe.VideoDecoder(path, device="cpu") as d:
        return d._scan


def _gop_scan(decode_display, keys):
    """A scan whose packets, in decode order, show the frames ``decode_display``."""
    import types

    pts = np.arange(len(decode_display), dtype=np.int64) * 512
    return types.SimpleNamespace(codec="hevc", pts=pts, keyframe_indices=np.array(keys),
                                 decode_pts=pts[np.array(decode_display)])


def test_open_gops_are_refused_for_the_simple_decoder(tmp_path):
    """circles_hevc.mp4 has a CRA every 15 frames whose two leading pictures are decoded after it
    (PyNvVideoCodec's SimpleDecoder handed out frame 15 for 13, and misdecoded leading pictures,
    labelled as the frames asked for); closed GOPs, B-frames or not, are left alone."""
    why = nv.simple_decoder_refusal(_scan_of(f"{_SAMPLES}/circles_hevc.mp4"))
    assert why is not None and "open GOPs" in why and "frame 15" in why
    for name in ("circles_h264.mp4", "squares_h264.mp4", "circles_vp9.webm", "squares_mjpeg.avi"):
        assert nv.simple_decoder_refusal(_scan_of(f"{_SAMPLES}/{name}")) is None, name
    hevc = make_video(tmp_path / "closed.mkv", codec="hevc", num_frames=30, width=160, height=144)
    assert nv.simple_decoder_refusal(_scan_of(hevc)) is None  # B-frames, closed GOPs
    # decode order 0 3 1 2 | 6 4 5: the keyframe at 6 is decoded before 4 and 5 (open)
    assert "frame 6" in nv.simple_decoder_refusal(_gop_scan([0, 3, 1, 2, 6, 4, 5], [0, 6]))
    # decode order 0 3 1 2 | 4 6 5: closed
    assert nv.simple_decoder_refusal(_gop_scan([0, 3, 1, 2, 4, 6, 5], [0, 4])) is None
    # a first keyframe that is not the first picture shown (leading pictures at the start)
    assert "frame 2" in nv.simple_decoder_refusal(_gop_scan([2, 0, 1, 3], [2]))
    unknown = _gop_scan([0, 2, 1], [0])
    unknown.decode_pts = None
    assert nv.simple_decoder_refusal(unknown) is None


def _backend_on(path, monkeypatch, mode):
    """NvdecBackend(...) on ``path`` with the GPU parts stood in for, AVPIPE_NVDEC_PACKETS=mode."""
    import sys
    import types

    from avpipe.device import Device

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=None, Device=_FakeCupy.cuda.Device)
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(nv, "pynvc", lambda: object())
    monkeypatch.setattr(nv, "nvdec_supports", lambda codec, gpu: True)
    monkeypatch.setattr(nv, "thread_stream", lambda gpu: types.SimpleNamespace(ptr=0))
    opened = []
    monkeypatch.setattr(nv, "_acquire", lambda *a: opened.append(a) or object())
    monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", mode)
    scan = _scan_of(path)
    source = types.SimpleNamespace(path=path)
    return (lambda: nv.NvdecBackend(source, scan, Device("cuda", 0))), opened


def test_an_open_gop_file_off_the_packet_path_is_refused(monkeypatch):
    """With the packet path off, NVDEC refuses an open-GOP file at open (the CPU decodes it and
    says why) and never opens a SimpleDecoder on it; a closed-GOP file still gets one."""
    make, opened = _backend_on(f"{_SAMPLES}/circles_hevc.mp4", monkeypatch, "0")
    with pytest.raises(nv.NvdecRefused, match="open GOPs"):
        make()
    assert opened == []
    make, opened = _backend_on(f"{_SAMPLES}/circles_h264.mp4", monkeypatch, "0")
    assert not make().packet_path and len(opened) == 1
    make, opened = _backend_on(f"{_SAMPLES}/circles_hevc.mp4", monkeypatch, "auto")
    b = make()
    assert b.packet_path and opened == [] and not b._simple_checked  # not worked out yet


def test_a_packet_path_failure_on_an_open_gop_file_goes_to_the_cpu(monkeypatch):
    """The packet path failing on an open-GOP file sends that request's frames to the CPU (not
    to the SimpleDecoder), and is not counted against the packet path: three such files must
    not turn it off for every later file."""
    monkeypatch.setattr(nv, "_packet_path", {"enabled": True, "why_off": None, "failures": 0})
    make, opened = _backend_on(f"{_SAMPLES}/circles_hevc.mp4", monkeypatch, "auto")
    b = make()

    def fails(targets, output, chw, out, slots):
        b._packet_failure, b.packet_path = "RuntimeError: odd", False
        return None

    b._decode_packets = fails
    b._simple = lambda: pytest.fail("the SimpleDecoder was used on an open-GOP file")
    for _ in range(4):
        b.packet_path = True
        got = b.decode([3, 13, 14], output="rgb", chw=False, out=None, slots=[[0], [1], [2]])
        assert got == [3, 13, 14]
    assert nv._packet_path == {"enabled": True, "why_off": None, "failures": 0}
    assert b._packet_failure is None and opened == []
