"""load_audio's GPU FLAC backend (FlacCudaEntry): what it accepts and why it refuses (the
window plan's own rule), that load_audio on a GPU routes a FLAC file to it and post-processes
its samples where they are, and (on a GPU) that its samples are libFLAC's bit for bit.
The CPU tests stand in a CUDA device (``Device("cuda", 0)``) and the GPU runner; the kernels
themselves run on the CPU in test_flac_kernels_cpu.py."""

from __future__ import annotations

import io

import numpy as np
import pytest

import avpipe
from avpipe._source import open_source
from avpipe.decoding import backends as B
from avpipe.decoding.audio import _flac_cuda as fc
from avpipe.decoding.audio import load as L
from avpipe.device import Device

sf = pytest.importorskip("soundfile")

SR = 16000
GPU = Device("cuda", 0)  # a CUDA device as resolve_device returns it; nothing here touches it


def _signal(n, channels=1, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    x = np.stack([0.4 * np.sin(2 * np.pi * 220 * (c + 1) * t) + 0.01 * rng.standard_normal(n)
                  for c in range(channels)], axis=1)
    return x.astype(np.float32)


def _flac(path, n=SR + 321, channels=1, subtype="PCM_16"):
    sf.write(path, _signal(n, channels), SR, subtype=subtype, format="FLAC")
    return str(path)


def _request(source, device=GPU, offset=0.0, duration=None):
    src = open_source(source)
    return B.AudioRequest(source=src, source_name=src.name, offset=offset, duration=duration,
                          device=device, flac=L._flac_length(src))


def _with_streaminfo(path, out, **fields):
    """A copy of the FLAC file ``path`` at ``out`` with STREAMINFO fields changed
    (``total_samples``, ``bits_per_sample``)."""
    data = bytearray(open(path, "rb").read())
    x = int.from_bytes(data[18:26], "big")  # rate(20) channels-1(3) bps-1(5) total(36)
    if "total_samples" in fields:
        x = (x & ~((1 << 36) - 1)) | fields["total_samples"]
    if "bits_per_sample" in fields:
        x = (x & ~(31 << 36)) | ((fields["bits_per_sample"] - 1) << 36)
    data[18:26] = x.to_bytes(8, "big")
    out.write_bytes(bytes(data))
    return str(out)


@pytest.fixture()
def gpu_ready(monkeypatch):
    """cupy and the kernels count as available (their check is the only GPU call of accepts)."""
    monkeypatch.setattr(L, "_gpu_problem", lambda device: None)


@pytest.fixture()
def on_host(monkeypatch):
    """The GPU runner and the upload stand in on the host: the runner decodes with libsndfile
    (each channel, [n, C] float32, as the GPU's item_channels gives), the upload keeps numpy;
    both record their calls."""
    calls = {"gpu": [], "upload": []}

    def run(buf, offsets, plan, device):
        calls["gpu"].append((int(offsets[-1]), plan.infos[0], device))
        data = bytes(buf[: int(offsets[-1])])
        x, _ = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return np.asfortranarray(x), None  # F-ordered, as item_channels' transposed view

    def upload(x, dev):
        calls["upload"].append((x.shape, dev))
        return x

    monkeypatch.setattr(L, "_decode_on_gpu", run)
    monkeypatch.setattr(L, "to_device", upload)
    return calls


def test_the_entry_is_first_in_the_audio_list():
    assert isinstance(B.backends("audio")[0], L.FlacCudaEntry)


def test_accepts_is_none_off_the_gpu_and_for_other_files(tmp_path, gpu_ready):
    e = L.FlacCudaEntry()
    flac = _flac(tmp_path / "a.flac")
    wav = tmp_path / "a.wav"
    sf.write(wav, _signal(800), SR)
    assert e.accepts(_request(flac, device=Device("cpu"))) is None
    assert e.accepts(_request(wav)) is None
    assert e.accepts(_request(flac)) is True
    assert e.accepts(_request(open(flac, "rb").read())) is True  # bytes
    with open(flac, "rb") as f:
        assert e.accepts(_request(f)) is True  # a file object


def test_accepts_refuses_spans_and_what_the_window_plan_leaves(tmp_path, gpu_ready):
    e = L.FlacCudaEntry()
    flac = _flac(tmp_path / "a.flac")
    for kw in (dict(offset=0.25), dict(duration=0.5), dict(offset=0.1, duration=0.2)):
        assert "whole files" in e.accepts(_request(flac, **kw))
    streamed = _with_streaminfo(flac, tmp_path / "streamed.flac", total_samples=0)
    assert e.accepts(_request(streamed)) == "STREAMINFO does not give the sample count"
    wide = _with_streaminfo(flac, tmp_path / "wide.flac", bits_per_sample=32)
    assert e.accepts(_request(wide)) == "32-bit samples"
    more = _with_streaminfo(flac, tmp_path / "more.flac", total_samples=SR * 10)
    req = _request(more)
    assert req.flac.problem and e.accepts(req) == req.flac.problem  # its frames say otherwise


def test_the_single_file_rule_is_the_window_plans_rule(tmp_path):
    """file_refusal (accepts) and plan_batch (the pipeline's windows) give one answer per
    file, from gpu_refusals."""
    flac = _flac(tmp_path / "a.flac")
    paths = [flac,
             _with_streaminfo(flac, tmp_path / "s.flac", total_samples=0),
             _with_streaminfo(flac, tmp_path / "w.flac", bits_per_sample=32),
             _with_streaminfo(flac, tmp_path / "lie.flac", total_samples=(1 << 36) - 1)]
    blobs = [open(p, "rb").read() for p in paths]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    buf = np.zeros(int(offsets[-1]) + fc.PAD, np.uint8)
    for b, o in zip(blobs, offsets):
        buf[o : o + len(b)] = np.frombuffer(b, np.uint8)
    plan = fc.plan_batch(buf, offsets)
    for i, b in enumerate(blobs):
        assert fc.file_refusal(fc.parse_streaminfo(b), len(b)) == plan.cpu.get(i)
    assert set(plan.cpu) == {1, 2, 3} and "more than its" in plan.cpu[3]


def test_accepts_says_when_cupy_is_missing(tmp_path):
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    else:
        pytest.skip("cupy imports here")
    assert L.FlacCudaEntry().accepts(_request(_flac(tmp_path / "a.flac"))).startswith(
        "cupy is not available")


def test_load_audio_on_a_gpu_routes_a_flac_to_the_gpu_decoder(tmp_path, gpu_ready, on_host):
    mono = _flac(tmp_path / "m.flac")
    st = _flac(tmp_path / "s.flac", channels=2, subtype="PCM_24")
    want_m, _ = sf.read(mono, dtype="float32")
    want_s, _ = sf.read(st, dtype="float32", always_2d=True)
    a = avpipe.load_audio(mono, device=GPU)
    assert a.backend == "flac_cuda" and a.fallbacks == () and a.damaged is None
    assert (a.sample_rate, a.source_channels, a.offset_samples) == (SR, 1, 0)
    np.testing.assert_array_equal(a.samples, want_m)
    # the stand-in's numpy samples are uploaded once, after the mixdown (cupy ones never are:
    # the GPU test below)
    assert on_host["gpu"][-1][2] is GPU and on_host["upload"] == [((len(want_m),), GPU)]
    b = avpipe.load_audio(st, device=GPU, mono=False)
    assert b.backend == "flac_cuda" and b.samples.shape == (2, len(want_s))
    assert b.samples.flags.c_contiguous
    np.testing.assert_array_equal(b.samples, want_s.T)
    np.testing.assert_array_equal(avpipe.load_audio(st, device=GPU, channel=1).samples,
                                  want_s[:, 1])
    np.testing.assert_array_equal(avpipe.load_audio(st, device=GPU).samples,
                                  avpipe.load_audio(st).samples)  # the same mixdown
    r = avpipe.load_audio(mono, device=GPU, sample_rate=8000)
    np.testing.assert_array_equal(r.samples, avpipe.load_audio(mono, sample_rate=8000).samples)
    assert r.backend == "flac_cuda" and r.source_sample_rate == SR and r.sample_rate == 8000
    c = avpipe.load_audio(open(mono, "rb").read(), device=GPU)  # bytes
    assert c.backend == "flac_cuda"
    np.testing.assert_array_equal(c.samples, want_m)
    assert len(on_host["gpu"]) == 6 and len(on_host["upload"]) == 6
    assert avpipe.load_audio(mono).backend == "soundfile"  # the CPU is not its business


def test_a_span_on_a_gpu_is_soundfiles_with_the_refusal_recorded(tmp_path, gpu_ready, on_host):
    mono = _flac(tmp_path / "m.flac")
    a = avpipe.load_audio(mono, device=GPU, offset=0.25, duration=0.5)
    assert a.backend == "soundfile" and len(a.fallbacks) == 1
    assert a.fallbacks[0].backend == "flac_cuda" and "whole files" in a.fallbacks[0].reason
    np.testing.assert_array_equal(a.samples,
                                  avpipe.load_audio(mono, offset=0.25, duration=0.5).samples)
    assert on_host["gpu"] == [] and on_host["upload"] == [((SR // 2,), GPU)]  # mixed, uploaded


def test_what_the_gpu_does_not_cover_goes_to_libflac(tmp_path, gpu_ready, monkeypatch):
    """The GPU's frames falling short (a damaged frame) or the runner failing is a refusal:
    libFLAC decodes the file, or raises a typed error naming it where it is damaged."""
    mono = _flac(tmp_path / "m.flac")
    want, _ = sf.read(mono, dtype="float32")
    monkeypatch.setattr(L, "to_device", lambda x, dev: x)
    why = "GPU frames cover 4096 of 16321 samples (a frame it could not decode)"
    monkeypatch.setattr(L, "_decode_on_gpu", lambda buf, offsets, plan, device: (None, why))
    a = avpipe.load_audio(mono, device=GPU)
    assert a.backend == "soundfile" and a.fallbacks == (B.Fallback("flac_cuda", why),)
    np.testing.assert_array_equal(a.samples, want)

    def fails(buf, offsets, plan, device):
        raise MemoryError("out of memory allocating 1 bytes")

    monkeypatch.setattr(L, "_decode_on_gpu", fails)
    a = avpipe.load_audio(mono, device=GPU)
    assert a.backend == "soundfile" and a.fallbacks[0].backend == "flac_cuda"
    assert a.fallbacks[0].reason.startswith("the GPU FLAC decoder failed (MemoryError")

    data = bytearray(open(mono, "rb").read())
    data[fc.parse_streaminfo(bytes(data)).audio_offset + 3000] ^= 0x10  # fails a CRC
    bad = tmp_path / "flipped.flac"
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(L, "_decode_on_gpu", lambda buf, offsets, plan, device: (None, why))
    with pytest.raises(avpipe.CorruptDataError, match="flipped.flac"):
        avpipe.load_audio(bad, device=GPU)


def test_refusals_by_the_header_need_no_gpu(tmp_path, gpu_ready, on_host):
    flac = _flac(tmp_path / "a.flac")
    streamed = _with_streaminfo(flac, tmp_path / "streamed.flac", total_samples=0)
    a = avpipe.load_audio(streamed, device=GPU)  # libsndfile refuses it too: FFmpeg decodes
    assert a.backend == "pyav" and on_host["gpu"] == [] and len(a.fallbacks) == 2
    assert a.fallbacks[0] == B.Fallback("flac_cuda", "STREAMINFO does not give the sample count")
    assert a.fallbacks[1].backend == "soundfile"
    np.testing.assert_array_equal(a.samples, avpipe.load_audio(flac).samples)


# --- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("subtype,channels,mono", [("PCM_16", 1, True), ("PCM_24", 2, False),
                                                   ("PCM_16", 2, True), ("PCM_S8", 1, False)])
def test_gpu_load_audio_decodes_flac_on_the_gpu_bit_exactly(tmp_path, monkeypatch, subtype,
                                                           channels, mono):
    import cupy

    def no_upload(x, dev):
        raise AssertionError("samples decoded on the GPU went through the host")

    monkeypatch.setattr(L, "to_device", no_upload)
    p = _flac(tmp_path / f"a_{subtype}_{channels}.flac", n=3 * SR + 123, channels=channels,
              subtype=subtype)
    a = avpipe.load_audio(p, device="cuda", mono=mono)
    assert a.backend == "flac_cuda" and a.fallbacks == ()
    assert isinstance(a.samples, cupy.ndarray) and a.samples.dtype == cupy.float32
    cpu = avpipe.load_audio(p, device="cpu", mono=mono)
    assert cpu.backend == "soundfile" and a.samples.shape == cpu.samples.shape
    np.testing.assert_array_equal(cupy.asnumpy(a.samples), cpu.samples)
    want, _ = sf.read(p, dtype="float32", always_2d=True)  # libFLAC's own samples
    if not mono:
        np.testing.assert_array_equal(cupy.asnumpy(a.samples), want.T)
    if channels == 2:
        c = avpipe.load_audio(p, device="cuda", channel=1)
        assert c.backend == "flac_cuda"
        np.testing.assert_array_equal(cupy.asnumpy(c.samples), want[:, 1])
    b = avpipe.load_audio(open(p, "rb").read(), device="cuda", mono=mono)  # bytes
    assert b.backend == "flac_cuda"
    np.testing.assert_array_equal(cupy.asnumpy(b.samples), cpu.samples)


@pytest.mark.gpu
def test_gpu_load_audio_span_and_resampling(tmp_path):
    import cupy

    p = _flac(tmp_path / "a.flac", n=3 * SR)
    a = avpipe.load_audio(p, device="cuda", offset=0.5, duration=1.0)
    assert a.backend == "soundfile" and a.fallbacks[0].backend == "flac_cuda"
    assert isinstance(a.samples, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(a.samples),
                                  avpipe.load_audio(p, offset=0.5, duration=1.0).samples)
    r = avpipe.load_audio(p, device="cuda", sample_rate=8000)
    assert r.backend == "flac_cuda" and isinstance(r.samples, cupy.ndarray)
    want = avpipe.load_audio(p, sample_rate=8000).samples
    assert r.samples.shape == want.shape
    np.testing.assert_allclose(cupy.asnumpy(r.samples), want, atol=1e-4)


@pytest.mark.gpu
def test_gpu_load_audio_damaged_flac_is_a_typed_error(tmp_path):
    p = _flac(tmp_path / "a.flac", n=3 * SR)
    data = bytearray(open(p, "rb").read())
    data[fc.parse_streaminfo(bytes(data)).audio_offset + 3000] ^= 0x10  # fails a frame's CRC
    bad = tmp_path / "flipped.flac"
    bad.write_bytes(bytes(data))
    with pytest.raises(avpipe.DecodeError, match="flipped.flac"):
        avpipe.load_audio(bad, device="cuda")
    cut = tmp_path / "cut.flac"
    cut.write_bytes(bytes(open(p, "rb").read())[: len(data) // 2])
    with pytest.raises(avpipe.CorruptDataError, match="cut.flac"):
        avpipe.load_audio(cut, device="cuda")
    a = avpipe.load_audio(cut, device="cuda", on_damage="warn")  # its frames' samples
    assert a.backend != "flac_cuda" and a.damaged
    assert a.fallbacks[0].backend == "flac_cuda"
