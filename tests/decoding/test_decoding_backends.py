"""The decoder seam (avpipe.decoding.backends): a registered backend decodes what it accepts,
and a refusal is reported the same way for video, audio and images."""

from __future__ import annotations

import os

import numpy as np
import pytest
import soundfile as sf
from paths import SAMPLES
from video_media import make_video

import avpipe
from avpipe.decoding import backends as B
from avpipe.errors import UnsupportedFormatError

SAMPLES = SAMPLES


class _SolidFrames:
    """An opened video backend: every frame it delivers is one grey level."""

    name = "toy"
    on_gpu = False
    damaged = None

    def __init__(self, level):
        self.level, self.closed = level, False

    def decode(self, targets, *, output, chw, out, slots):
        for rows in slots:
            for r in rows:
                out[r] = self.level
        return []

    def close(self):
        self.closed = True


class _ToyVideo:
    """Accepts H.264 on the CPU; refuses every other codec, saying why."""

    name = "toy"

    def __init__(self, codec="h264"):
        self.codec, self.opened = codec, []

    def accepts(self, req):
        if req.device.is_cuda:
            return None
        if req.codec != self.codec:
            return f"toy decodes {self.codec} only, not {req.codec}"
        return True

    def open(self, req):
        self.opened.append(_SolidFrames(77))
        return self.opened[-1]


class _ToyAudio:
    """Accepts WAV files (by the name): a ramp of 100 samples at 8 kHz; refuses the rest."""

    name = "toy"

    def accepts(self, req):
        if not req.source_name.endswith(".wav"):
            return "toy decodes .wav only"
        return True

    def decode(self, req):
        return np.arange(100, dtype=np.float32)[:, None] / 100, 8000, 1, 0, None


@pytest.fixture()
def video(tmp_path):
    return make_video(tmp_path / "v.mp4", codec="h264", num_frames=10)


def test_the_lists_name_the_builtin_backends_in_order():
    assert [b.name for b in B.backends("video")] == ["nvdec", "pyav"]
    assert [b.name for b in B.backends("audio")] == ["flac_cuda", "soundfile", "pyav"]
    assert [b.name for b in B.backends("image")] == ["isolated", "nvimgcodec", "dali_cpu"]
    for kind in B.KINDS:
        assert all(isinstance(b, B.Backend) for b in B.backends(kind))
    with pytest.raises(ValueError, match="kind must be one of"):
        B.backends("text")


def test_a_registered_video_backend_decodes_what_it_accepts(video):
    toy = _ToyVideo()
    with B.registered("video", toy, before="pyav"):
        with avpipe.VideoDecoder(video, device="cpu") as d:
            got = d.get_frames([3, 0, 3])
            assert d.backend == "toy" and d.fallbacks == [] and d.fallback_reason is None
        assert toy.opened[0].closed
    assert got.data.shape == (3, 96, 128, 3) and (got.data == 77).all()
    with avpipe.VideoDecoder(video, device="cpu") as d:  # the list is as it was
        assert d.backend == "pyav" and not (d.get_frames([3]).data == 77).all()


def test_a_registered_audio_backend_decodes_what_it_accepts(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(path, np.zeros(1600, np.float32), 16000)
    with B.registered("audio", _ToyAudio(), before="soundfile"):
        a = avpipe.load_audio(path)
    assert a.backend == "toy" and a.fallbacks == () and a.sample_rate == 8000
    np.testing.assert_allclose(a.samples, np.arange(100) / 100)
    a = avpipe.load_audio(path)
    assert a.backend == "soundfile" and a.num_samples == 1600


def test_a_refusal_is_reported_the_same_way_for_video_audio_and_images(video, tmp_path, caplog):
    """The backend that refused and its words, in ``.fallbacks`` as :class:`Fallback`, and one
    log line of one shape; the next backend decodes."""
    with B.registered("video", _ToyVideo(codec="vp9"), before="pyav"):
        with caplog.at_level("DEBUG", logger="avpipe"):
            with avpipe.VideoDecoder(video, device="cpu") as d:
                want = B.Fallback("toy", "toy decodes vp9 only, not h264")
                assert d.backend == "pyav" and d.fallbacks == [want]
                assert d.fallback_reason == want.reason
    flac = os.path.join(SAMPLES, "speech", "utt03.flac")
    with B.registered("audio", _ToyAudio(), before="soundfile"):
        with caplog.at_level("DEBUG", logger="avpipe"):
            a = avpipe.load_audio(flac)
    assert a.backend == "soundfile" and a.fallbacks == (B.Fallback("toy", "toy decodes .wav only"),)
    lines = [r.getMessage() for r in caplog.records if "refused it" in r.getMessage()]
    assert lines == [f"avpipe: {video}: toy refused it (toy decodes vp9 only, not h264); decoding "
                     "with pyav", f"avpipe: {flac}: toy refused it (toy decodes .wav only); "
                     "decoding with soundfile"]  # fmt: skip

    class Picky:
        name = "picky"

        def accepts(self, req):
            return f"picky decodes no {req.fmt}"

    jpg = os.path.join(SAMPLES, "images", "scene.jpg")
    with B.registered("image", Picky(), before="isolated"):
        batch = avpipe.decoding.decode_image_batch([jpg], device="cpu")
    assert batch.backends == ("dali_cpu",)
    assert batch.fallbacks == ((0, B.Fallback("picky", "picky decodes no jpeg")),)


def test_no_backend_left_raises_naming_the_refusals(video, tmp_path):
    path = tmp_path / "a.ogg"
    sf.write(path, np.zeros(800, np.float32), 8000)

    class No:
        name = "no"

        def accepts(self, req):
            return "never"

    saved = B.backends("audio")
    try:
        for b in saved:
            B.unregister("audio", b.name)
        B.register("audio", No())
        with pytest.raises(UnsupportedFormatError, match=r"a\.ogg.*no: never"):
            avpipe.load_audio(path)
    finally:
        B.unregister("audio", "no")
        for b in saved:
            B.register("audio", b)
    assert [b.name for b in B.backends("audio")] == [b.name for b in saved]


def test_register_checks_its_arguments():
    with pytest.raises(ValueError, match="before='nope' names no video backend"):
        B.register("video", _ToyVideo(), before="nope")
    with pytest.raises(TypeError, match="accepts"):
        B.register("video", object())
    toy = _ToyVideo()
    with B.registered("video", toy):
        assert B.backends("video")[-1] is toy
        other = _ToyVideo()
        B.register("video", other)  # the same name replaces it in its place
        assert B.backends("video")[-1] is other and len(B.backends("video")) == 3
    assert [b.name for b in B.backends("video")] == ["nvdec", "pyav"]


def test_video_metadata_is_a_read_only_view_of_the_scan(video):
    import pickle

    with avpipe.VideoDecoder(video, device="cpu") as d:
        m = d.metadata
    assert m.scan is d._scan and m.num_frames == 10 and m.pixel_format == m.scan.pix_fmt
    assert m.pts_seconds.tolist() == pytest.approx((m.scan.pts * float(m.scan.time_base)).tolist())
    with pytest.raises(AttributeError, match="read-only"):
        m.width = 1
    with pytest.raises(ValueError):
        m.pts_seconds[0] = 1.0
    back = pickle.loads(pickle.dumps(m))
    assert back.num_frames == 10 and back.pts_seconds.tolist() == m.pts_seconds.tolist()
