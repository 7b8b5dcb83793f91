"""Damaged inputs: damage is reported (``Audio.damaged``, ``VideoMetadata.damaged``,
``FrameBatch.damaged``) or raised with ``strict=True``; image errors read as sentences and the
native decoders' own lines stay off stderr; the batch loader keeps its state per loader and
reports timeouts as :class:`~avpipe.DecodeTimeoutError`."""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest
import soundfile as sf
from paths import REPO, SAMPLES
from stalls import let_loader_read_pipes

import avpipe
from avpipe.errors import CorruptDataError, DecodeTimeoutError

SR = 16000


def _cut(src, dst, fraction):
    data = open(src, "rb").read()
    open(dst, "wb").write(data[: int(len(data) * fraction)])
    return str(dst)


# --- audio ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("subtype", ["PCM_16", "FLOAT"])
def test_truncated_wav_raises_or_is_flagged_with_on_damage_warn(tmp_path, subtype):
    x = np.sin(np.arange(SR) / 7).astype(np.float32) * 0.5
    p = tmp_path / "a.wav"
    sf.write(p, x, SR, subtype=subtype)
    clean = avpipe.load_audio(p)
    assert clean.damaged is None and clean.num_samples == SR
    cut = _cut(p, tmp_path / "cut.wav", 0.6)
    with pytest.raises(CorruptDataError, match="truncated") as ei:
        avpipe.load_audio(cut)  # the default: damage is an error
    assert ei.value.source == cut
    a = avpipe.load_audio(cut, on_damage="warn")
    assert 0 < a.num_samples < SR
    assert a.damaged and "truncated" in a.damaged and "data chunk" in a.damaged
    np.testing.assert_allclose(a.samples, clean.samples[: a.num_samples], atol=1e-4)
    with pytest.raises(CorruptDataError, match="truncated") as ei:
        avpipe.load_audio(cut, strict=True)
    assert ei.value.source == cut


def test_truncated_ogg_and_flac_are_corrupt_not_unsupported(tmp_path):
    x = (np.sin(np.arange(2 * SR) / 9) * 0.4).astype(np.float32)
    for ext, kw in (("ogg", {"format": "OGG", "subtype": "VORBIS"}), ("flac", {})):
        p = tmp_path / f"a.{ext}"
        sf.write(p, x, SR, **kw)
        assert avpipe.load_audio(p).damaged is None
        for frac in (0.3, 0.7, 0.97):
            cut = _cut(p, tmp_path / f"cut{frac}.{ext}", frac)
            with pytest.raises(CorruptDataError):
                avpipe.load_audio(cut)
            try:
                a = avpipe.load_audio(cut, on_damage="warn")
            except CorruptDataError:
                continue
            assert a.damaged, (ext, frac)  # decoded what is there: it says so


def test_nan_float_wav_is_corrupt(tmp_path):
    x = np.zeros(1000, np.float32)
    x[500] = np.nan
    p = tmp_path / "nan.wav"
    sf.write(p, x, SR, subtype="FLOAT")
    with pytest.raises(CorruptDataError, match="NaN"):
        avpipe.load_audio(p)


def test_wav_with_absurd_header_fields_is_typed(tmp_path):
    p = tmp_path / "a.wav"
    sf.write(p, np.zeros(800, np.float32), SR, subtype="PCM_16")
    data = bytearray(open(p, "rb").read())
    for at, fmt, v in ((24, "<I", 0), (22, "<H", 0), (22, "<H", 0xFFFF), (34, "<H", 0)):
        b = bytearray(data)
        struct.pack_into(fmt, b, at, v)
        q = tmp_path / f"bad{at}_{v}.wav"
        q.write_bytes(bytes(b))
        # a sample rate, channel count or sample width of 0 (or 65535 channels) cannot be
        # decoded: a typed error naming the file, never samples nor an untyped exception
        with pytest.raises(avpipe.DecodeError, match=re.escape(q.name)):
            avpipe.load_audio(q)


# --- video ---------------------------------------------------------------------------------------


def _webm(path, n=30):
    import av

    with av.open(str(path), "w", format="webm") as out:
        st = out.add_stream("libvpx-vp9", rate=25)
        st.width, st.height, st.pix_fmt = 64, 48, "yuv420p"
        st.options = {"deadline": "realtime", "cpu-used": "8", "g": "5"}
        for i in range(n):
            a = np.full((48, 64, 3), (i * 8) % 256, np.uint8)
            for pkt in st.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    return str(path)


def test_truncated_webm_is_flagged_and_strict_raises(tmp_path):
    p = _webm(tmp_path / "v.webm")
    with avpipe.VideoDecoder(p, device="cpu") as dec:
        assert dec.metadata.damaged is None and len(dec) == 30
        assert dec.get_frames([0, 29]).damaged is None
    cut = _cut(p, tmp_path / "cut.webm", 0.6)
    with avpipe.VideoDecoder(cut, device="cpu") as dec:
        assert 0 < len(dec) < 30
        assert dec.metadata.damaged and "truncated" in dec.metadata.damaged
        b = dec.get_frames([0])
        assert b.damaged == dec.metadata.damaged
    with pytest.raises(CorruptDataError, match="truncated"):
        avpipe.VideoDecoder(cut, device="cpu", strict=True)


# --- images --------------------------------------------------------------------------------------


def _png(path):
    from PIL import Image

    a = np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)
    Image.fromarray(a).save(path, "PNG")
    return open(path, "rb").read()


def test_truncated_png_error_is_a_sentence_and_stderr_stays_clean(tmp_path, capfd):
    data = _png(tmp_path / "a.png")
    cut = tmp_path / "cut.png"
    cut.write_bytes(data[: len(data) // 2])
    bad_crc = tmp_path / "crc.png"
    b = bytearray(data)
    b[20] ^= 0x01  # the IHDR height: its CRC no longer matches
    bad_crc.write_bytes(bytes(b))
    capfd.readouterr()
    with pytest.raises(CorruptDataError) as ei:
        avpipe.decode_images([str(cut)], device="cpu")
    assert "the PNG data ends early (" in str(ei.value) and str(cut) in str(ei.value)
    with pytest.raises(CorruptDataError) as ei:
        avpipe.decode_images([str(bad_crc)], device="cpu")
    assert "the PNG data is corrupt" in str(ei.value) and str(bad_crc) in str(ei.value)
    batch = avpipe.decoding.image.decode_image_batch([str(cut), str(tmp_path / "a.png")],
                                                     device="cpu")  # fmt: skip
    assert batch.images[1] is not None and batch.errors[0][0] == 0
    out = capfd.readouterr()
    assert out.err == "", out.err


def test_native_failure_codes_become_sentences():
    from avpipe.decoding.image._cpu import _classify

    png = b"\x89PNG\r\n\x1a\n" + bytes(40)
    e = RuntimeError("Error in thread 0: nvImageCodec failure: '#17'")
    e.native_log = "[ERROR] [png_parser] Could not retrieve image info - Unexpected end of stream"
    err = _classify("x.png", png, e)
    assert isinstance(err, CorruptDataError)
    assert str(err).startswith("x.png: the PNG data ends early (truncated)")
    assert "Unexpected end of stream" in str(err) and "[ERROR]" not in str(err)
    err = _classify("y.jp2", b"\xff\x4f\xff\x51" + bytes(20), RuntimeError("'#3'"))
    assert "the JPEG 2000 data is corrupt" in str(err)


def test_jpeg2000_cut_before_its_first_tile_is_refused_before_decoding(tmp_path):
    data = open(os.path.join(SAMPLES, "images", "scene.jp2"), "rb").read()
    head = data[: data.find(b"\xff\x90")]
    for _ in range(3):  # OpenJPEG crashed the process on this after an earlier decode
        with pytest.raises(CorruptDataError, match="JPEG 2000 data ends early"):
            avpipe.decode_images([head], device="cpu")
        avpipe.decode_images([data], device="cpu")
    from avpipe.pipeline.image_stream import decode_image_stream

    good = tmp_path / "good.jp2"
    good.write_bytes(data)
    cut = tmp_path / "cut.jp2"
    cut.write_bytes(head)
    got = list(decode_image_stream([str(good)] * 3 + [str(cut), str(good)], batch_size=2,
                                   device="cpu"))  # fmt: skip
    assert [len(b.images) for b in got] == [2, 2, 1]
    assert [b.errors[0][0] for b in got if b.errors] == [1]
    assert "JPEG 2000 data ends early" in str(got[1].errors[0][1])
    assert got[1].images[0] is not None and got[2].images[0] is not None


# --- the audio batch loader ------------------------------------------------------------------------


def test_two_loaders_keep_their_own_buffers(tmp_path):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    def files(tag, value, n, k):
        out = []
        for i in range(k):
            p = tmp_path / f"{tag}{i}.wav"
            sf.write(p, np.full(n + i, value, np.float32), SR, subtype="PCM_16")
            out.append(str(p))
        return out

    a_files, b_files = files("a", 0.25, 300, 2), files("b", -0.5, 700, 3)
    with AudioBatchLoader(a_files, batch_size=2, num_workers=1, device="cpu") as a, \
            AudioBatchLoader(b_files, batch_size=3, num_workers=1, device="cpu") as b:  # noqa: E127
        a._restart_pool([])  # new workers for the first loader after the second was built
        ((xa, la, _, ea),) = list(a.batches())
        ((xb, lb, _, eb),) = list(b.batches())
    assert not ea and la.tolist() == [300, 301]
    np.testing.assert_allclose(xa[0, :300], 0.25, atol=1e-4)
    np.testing.assert_allclose(xa[1, :301], 0.25, atol=1e-4)
    assert not eb and lb.tolist() == [700, 701, 702]
    np.testing.assert_allclose(xb[2, :702], -0.5, atol=1e-4)


def test_loader_timeout_is_a_decode_timeout_error(tmp_path, monkeypatch):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    let_loader_read_pipes(monkeypatch, tmp_path)

    good = tmp_path / "g.flac"
    sf.write(good, np.full(800, 0.25, np.float32), SR, subtype="PCM_16")
    stuck = tmp_path / "stuck.flac"
    os.mkfifo(stuck)  # a read that never returns
    paths = [str(good), str(stuck)]
    with AudioBatchLoader(paths, batch_size=2, num_workers=1, device="cpu", max_samples=1000,
                          timeout=1.0) as loader:  # fmt: skip
        ((_, lengths, _, errors),) = list(loader.batches())
    assert [i for i, _ in errors] == [1] and lengths[0] == 800
    assert isinstance(errors[0][1], DecodeTimeoutError) and errors[0][1].source == str(stuck)
    with AudioBatchLoader(paths, batch_size=2, num_workers=1, device="cpu", max_samples=1000,
                          timeout=1.0, strict=True) as loader:  # fmt: skip
        with pytest.raises(DecodeTimeoutError) as ei:
            list(loader.batches())
    assert ei.value.source == str(stuck)


def test_loader_worker_that_dies_fails_its_chunk_and_the_loader_goes_on(tmp_path, monkeypatch):
    """A decoding worker process that dies (a native crash; here killed while it reads a file
    that never returns) fails the files of its chunk at once, not at the timeout, and later
    batches decode on a new worker."""
    import signal
    import threading
    import time

    from avpipe.pipeline.audio_loader import AudioBatchLoader

    let_loader_read_pipes(monkeypatch, tmp_path)
    good = []
    for i in range(3):
        p = tmp_path / f"g{i}.flac"
        sf.write(p, np.full(800 + i, 0.25, np.float32), SR, subtype="PCM_16")
        good.append(str(p))
    stuck = tmp_path / "stuck.flac"
    os.mkfifo(stuck)
    paths = [str(stuck), good[0], good[1], good[2]]
    with AudioBatchLoader(paths, batch_size=2, num_workers=1, device="cpu", max_samples=1000,
                          timeout=60.0, prefetch=1) as loader:  # fmt: skip
        def kill_when_busy():
            for _ in range(500):
                ws = loader._pool._state["workers"]
                if ws:
                    time.sleep(0.3)  # inside the read of the fifo
                    os.kill(ws[0].pid, signal.SIGKILL)
                    return
                time.sleep(0.01)

        t = threading.Thread(target=kill_when_busy)
        t.start()
        t0 = time.monotonic()
        batches = list(loader.batches())
        t.join()
    assert time.monotonic() - t0 < 30  # not the 60 s timeout
    (_, l0, _, e0), (_, l1, _, e1) = batches
    assert [i for i, _ in e0] == [0] and "ended" in str(e0[0][1]) and l0[1] == 800
    assert isinstance(e0[0][1], CorruptDataError) and e0[0][1].source == str(stuck)
    assert not e1 and l1.tolist() == [801, 802]


def test_loader_reports_absurd_headers_per_item(tmp_path):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    good = []
    for i in range(2):
        p = tmp_path / f"g{i}.flac"
        sf.write(p, np.full(500, 0.25, np.float32), SR, subtype="PCM_16")
        good.append(str(p))
    data = open(good[0], "rb").read()
    huge = bytearray(data)  # STREAMINFO: 2^36 - 1 samples
    bits = int.from_bytes(huge[18:26], "big") | ((1 << 36) - 1)
    huge[18:26] = bits.to_bytes(8, "big")
    slow = bytearray(data)  # sample rate 1 Hz
    bits = (int.from_bytes(slow[18:26], "big") & ~(0xFFFFF << 44)) | (1 << 44)
    slow[18:26] = bits.to_bytes(8, "big")
    bad = []
    for name, b in (("huge.flac", huge), ("rate1.flac", slow)):
        (tmp_path / name).write_bytes(bytes(b))
        bad.append(str(tmp_path / name))
    paths = [good[0], bad[0], bad[1], good[1]]
    with AudioBatchLoader(paths, batch_size=4, num_workers=1, device="cpu") as loader:
        ((x, lengths, _, errors),) = list(loader.batches())
    assert loader.sample_rate == SR
    assert lengths[0] == 500 and lengths[3] == 500 and {i for i, _ in errors} == {1, 2}


def test_jpeg2000_with_an_inconsistent_header_is_refused_before_decoding(tmp_path):
    """OpenCV's OpenJPEG (DALI's CPU JPEG 2000 decoder) crashed the process on these after a
    good decode: a flipped marker code, a wrong SIZ length, a COM length sending the walk astray."""
    from avpipe.decoding.image import j2k_header_problem

    data = open(os.path.join(SAMPLES, "images", "scene.jp2"), "rb").read()
    assert j2k_header_problem(data) is None
    siz = data.find(b"\xff\x51")
    bad_len = bytearray(data)
    bad_len[siz + 3] ^= 0x40
    unknown = bytearray(data)
    unknown[data.find(b"\xff\x52", siz) + 1] = 0x6C  # COD's marker code
    for b, why in ((bad_len, "SIZ"), (unknown, "unknown marker 0xFF6C")):
        avpipe.decode_images([data], device="cpu")
        for _ in range(2):
            with pytest.raises(CorruptDataError, match="JPEG 2000 header is corrupt") as ei:
                avpipe.decode_images([bytes(b)], device="cpu")
            assert why in str(ei.value)


def test_float_wav_with_inconsistent_format_chunk_is_corrupt(tmp_path):
    """libsndfile refuses it (its PEAK chunk no longer matches); FFmpeg, the fallback, crashed
    the process reading 9 channels of 32-bit floats from 4-byte blocks."""
    p = tmp_path / "f.wav"
    sf.write(p, np.zeros(900, np.float32), SR, subtype="FLOAT")
    b = bytearray(open(p, "rb").read())
    struct.pack_into("<H", b, 22, 9)
    q = tmp_path / "nine.wav"
    q.write_bytes(bytes(b))
    with pytest.raises(CorruptDataError, match="format chunk is inconsistent"):
        avpipe.load_audio(q)


@pytest.mark.parametrize("codec", ["h264", "hevc", "vp8", "vp9", "mjpeg"])
def test_clean_videos_are_not_flagged(tmp_path, codec):
    """Shifted and variable-rate clean files are not 'damaged' (MKV durations count from 0,
    AVI frame counts count time slots)."""
    import fractions

    from video_media import CODECS, make_video

    ext = CODECS[codec][2]
    tb = fractions.Fraction(1, 25)
    files = [
        make_video(tmp_path / f"plain.{ext}", codec=codec, num_frames=12),
        make_video(tmp_path / f"vfr.{ext}", codec=codec, num_frames=6,
                   pts=[0, 1, 3, 4, 8, 20], time_base=tb),
        make_video(tmp_path / f"shift.{ext}", codec=codec, num_frames=6,
                   pts=[50 + i for i in range(6)], time_base=tb),
    ]  # fmt: skip
    for f in files:
        with avpipe.VideoDecoder(f, device="cpu", strict=True) as dec:
            assert dec.metadata.damaged is None, (f, dec.metadata.damaged)
            assert dec.get_frames([0, -1]).damaged is None


def test_streamed_wav_with_unknown_data_size_is_not_flagged(tmp_path):
    """WAV written to a pipe keeps a placeholder data size (0 or 0xFFFFFFFF): not damage."""
    p = tmp_path / "a.wav"
    sf.write(p, np.full(1000, 0.25, np.float32), SR, subtype="PCM_16")
    b = bytearray(open(p, "rb").read())
    at = b.find(b"data") + 4
    for v in (0xFFFFFFFF,):
        struct.pack_into("<I", b, at, v)
        q = tmp_path / f"s{v}.wav"
        q.write_bytes(bytes(b))
        a = avpipe.load_audio(q)
        assert a.num_samples == 1000 and a.damaged is None


def test_loader_refuses_files_cut_short_or_lists_them_with_on_damage_warn(tmp_path):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    p = tmp_path / "a.wav"
    sf.write(p, np.full(4000, 0.25, np.float32), SR, subtype="PCM_16")
    cut = _cut(p, tmp_path / "cut.wav", 0.5)
    with AudioBatchLoader([str(p), cut], batch_size=2, num_workers=1, device="cpu") as loader:
        ((_, lengths, _, errors),) = list(loader.batches())
    assert lengths.tolist() == [4000, 0] and not loader.damaged
    ((i, e),) = errors
    assert i == 1 and isinstance(e, CorruptDataError) and e.source == cut
    assert "truncated" in e.cause
    with AudioBatchLoader([str(p), cut], batch_size=2, num_workers=1, device="cpu",
                          on_damage="warn") as loader:
        ((_, lengths, _, errors),) = list(loader.batches())
    assert not errors and lengths[0] == 4000 and 0 < lengths[1] < 4000
    assert set(loader.damaged) == {cut} and "truncated" in loader.damaged[cut]


_PIPES = r"""
import json, os, shutil, sys
import avpipe
from avpipe.errors import UnsupportedFormatError
d, samples = sys.argv[1], sys.argv[2]
for name in ("p.wav", "p.mp4", "p.jpg"):
    os.mkfifo(os.path.join(d, name))
shutil.copy(os.path.join(samples, "speech", "utt01.wav"), os.path.join(d, "a.wav"))
out = {}
for name, call in (("p.mp4", lambda p: avpipe.VideoDecoder(p, device="cpu")),
                   ("p.wav", lambda p: avpipe.load_audio(p)),
                   ("p.jpg", lambda p: avpipe.decode_images([p], device="cpu"))):
    try:
        call(os.path.join(d, name))
        out[name] = "no error"
    except UnsupportedFormatError as e:
        out[name] = "UnsupportedFormatError" if os.path.join(d, name) in str(e) else str(e)
with open(os.path.join(d, "m.jsonl"), "w") as f:
    for name in ("a.wav", "p.wav"):
        f.write(json.dumps({"audio_filepath": name, "duration": 3.0, "text": "x"}) + "\n")
for decoder in ("threads", "processes"):
    feed = avpipe.recipes.rnnt_feed(os.path.join(d, "m.jsonl"), batch_size=2, device="cpu",
                                    decoder=decoder)
    n = sum(len(b.paths) for b in feed)
    out["feed_" + decoder] = [n, [e.split(":")[0] for _, e in feed.errors]]
from avpipe.recipes.extract import run_extract
os.remove(os.path.join(d, "m.jsonl"))
s = run_extract(d, preset="quickstart", out_dir=os.path.join(d, "..", "out"), device="cpu")
rows = [json.loads(l) for l in open(os.path.join(d, "..", "out", "errors.jsonl"))]
out["extract"] = [s.total_written, sorted((r["source"], r["error"]) for r in rows)]
print(json.dumps(out))
"""


def test_pipes_are_refused_never_read(tmp_path):
    """A named pipe with a media name (a FIFO called x.wav) is refused with a typed error naming
    it by the decoders, skipped by the feeds and listed by extraction, without being opened:
    reading one blocks until a writer comes (the run hung). In a subprocess, so a regression
    fails on its timeout instead of hanging the suite."""
    import json
    import subprocess
    import sys

    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")
    d = tmp_path / "in"
    d.mkdir()
    root = REPO
    p = subprocess.run([sys.executable, "-c", _PIPES, str(d), os.path.join(root, "samples")],
                       capture_output=True, text=True, timeout=240, cwd=root,
                       env={**os.environ, "PYTHONPATH": root, "AVPIPE_DISABLE_GPU": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["p.mp4"] == out["p.wav"] == out["p.jpg"] == "UnsupportedFormatError", out
    for decoder in ("threads", "processes"):
        assert out["feed_" + decoder] == [1, ["UnsupportedFormatError"]], out
    written, errors = out["extract"]
    assert written == 1 and errors == [["p.jpg", "UnsupportedFormatError"],
                                       ["p.mp4", "UnsupportedFormatError"],
                                       ["p.wav", "UnsupportedFormatError"]], out


# --- audio: header totals that lie, streamed FLAC -------------------------------------------------


def _flac_total(data: bytes, total: int) -> bytes:
    """FLAC bytes with STREAMINFO's sample count set to ``total`` (0: unknown, as FFmpeg writes
    a stream to a pipe)."""
    b = bytearray(data)
    at = 8 + 10
    v = int.from_bytes(b[at : at + 8], "big")
    b[at : at + 8] = ((v & ~((1 << 36) - 1)) | total).to_bytes(8, "big")
    return bytes(b)


@pytest.fixture
def flacs(tmp_path):
    x = (np.sin(np.arange(3 * SR) / 9) * 0.4).astype(np.float32)
    p = tmp_path / "a.flac"
    sf.write(p, x, SR, subtype="PCM_16")
    want, _ = sf.read(p, dtype="float32")
    out = {"clean": str(p)}
    for name, total in (("streamed", 0), ("few", 100), ("many", 3 * SR + 5000)):
        q = tmp_path / f"{name}.flac"
        q.write_bytes(_flac_total(p.read_bytes(), total))
        out[name] = str(q)
    return out, want


def test_streamed_flac_decodes_whole_everywhere(flacs):
    """STREAMINFO count 0 ("unknown", a stream written to a pipe): every sample, no damage, in
    load_audio (whole and a span) and the batch loader (its length from the frames)."""
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    f, want = flacs
    a = avpipe.load_audio(f["streamed"])
    assert a.damaged is None and a.num_samples == len(want)
    np.testing.assert_array_equal(a.samples, want)
    b = avpipe.load_audio(f["streamed"], offset=1.0, duration=0.5)
    np.testing.assert_array_equal(b.samples, want[SR : SR + SR // 2])
    with AudioBatchLoader([f["clean"], f["streamed"]], batch_size=2, num_workers=1,
                          device="cpu", transport="float32") as loader:  # fmt: skip
        ((x, lengths, _, errors),) = list(loader.batches())
    assert not errors and lengths.tolist() == [len(want)] * 2
    np.testing.assert_array_equal(x[1], want)


@pytest.mark.parametrize("name,what", [("few", "fewer"), ("many", "more")])
def test_flac_whose_streaminfo_count_lies_is_an_error_or_decoded_whole(flacs, name, what):
    """A STREAMINFO count its frames contradict: CorruptDataError naming the file by default
    (libsndfile returned the first 100 of 48,000 samples, no note); with on_damage="warn" every
    sample the frames hold, and the note. The batch loader the same."""
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    f, want = flacs
    with pytest.raises(CorruptDataError, match=f"declares .* samples, {what} than the 48000") as ei:
        avpipe.load_audio(f[name])
    assert ei.value.source == f[name]
    a = avpipe.load_audio(f[name], on_damage="warn")
    assert a.damaged and "STREAMINFO" in a.damaged
    np.testing.assert_array_equal(a.samples, want)
    with AudioBatchLoader([f["clean"], f[name]], batch_size=2, num_workers=1,
                          device="cpu") as loader:  # fmt: skip
        ((_, lengths, _, errors),) = list(loader.batches())
    assert lengths.tolist() == [len(want), 0] and [i for i, _ in errors] == [1]
    assert isinstance(errors[0][1], CorruptDataError) and "STREAMINFO" in errors[0][1].cause
    with AudioBatchLoader([f["clean"], f[name]], batch_size=2, num_workers=1, device="cpu",
                          on_damage="warn") as loader:  # fmt: skip
        ((_, lengths, _, errors),) = list(loader.batches())
    assert not errors and lengths.tolist() == [len(want)] * 2 and f[name] in loader.damaged


def test_ogg_with_a_bad_crc_page_is_an_error(tmp_path):
    """One page of an Ogg stream with a bad CRC: libsndfile skips it (fewer samples than the
    stream's last granule position says, those after the gap shifted): an error by default."""
    rng = np.random.default_rng(0)
    x = (0.3 * np.sin(np.arange(6 * SR) / 7) + 0.05 * rng.standard_normal(6 * SR))
    p = tmp_path / "a.ogg"
    sf.write(p, x.astype(np.float32), SR, format="OGG", subtype="VORBIS")
    b = bytearray(p.read_bytes())
    pages = [i for i in range(len(b) - 4) if b[i : i + 4] == b"OggS"]
    b[pages[len(pages) // 2] + 40] ^= 0xFF  # a payload byte: the page's CRC fails
    q = tmp_path / "crc.ogg"
    q.write_bytes(bytes(b))
    assert avpipe.load_audio(p).num_samples == 6 * SR
    with pytest.raises(CorruptDataError, match="samples its header declares"):
        avpipe.load_audio(q)
    a = avpipe.load_audio(q, on_damage="warn")
    assert a.damaged and a.num_samples < 6 * SR
# --- reads that never return ---------------------------------------------------------------------

_STUCK_FEED = r"""
import gc, json, os, sys, time
import numpy as np, soundfile as sf
import avpipe
d = sys.argv[1]
os.mkfifo(os.path.join(d, "stuck.wav"))  # a "regular" file here (pipes_read_as_files)
with open(os.path.join(d, "m.jsonl"), "w") as f:
    for name in ["stuck.wav"] + [f"a{i}.wav" for i in range(3)] + ["stuck.wav"]:
        if name != "stuck.wav":
            sf.write(os.path.join(d, name), np.full(1600, 0.25, np.float32), 16000)
        f.write(json.dumps({"audio_filepath": name, "duration": 0.1, "text": "x"}) + "\n")
    # a part of it (the decoder reads the file itself)
    f.write(json.dumps({"audio_filepath": "stuck.wav", "offset": 0.01, "duration": 0.05,
                        "text": "x"}) + "\n")
m = os.path.join(d, "m.jsonl")
out = {}
# the default deadline (AVPIPE_FEED_DEADLINE=1 here): each epoch skips the stuck items
feed = avpipe.recipes.rnnt_feed(m, batch_size=2, device="cpu", training=False, shuffle=False,
                                threads=2)
for epoch in range(2):
    t0 = time.monotonic()
    n, errs = 0, []
    for b in feed:  # each batch carries the errors of the items skipped while making it
        n += len(b.paths)
        errs += b.errors
    out[f"epoch{epoch}"] = [n, time.monotonic() - t0,
                            [(os.path.basename(p), e.split(":")[0]) for p, e in errs]]
t0 = time.monotonic()
del feed
gc.collect()
out["del"] = time.monotonic() - t0
# no deadline: a feed dropped while its producer waits on a stuck item does not wait for it
feed = avpipe.recipes.rnnt_feed(m, batch_size=2, device="cpu", training=False, shuffle=False,
                                threads=2, deadline=None)
it = iter(feed)
time.sleep(0.5)  # the producer is inside the first batch, whose first item never comes
t0 = time.monotonic()
del it, feed
gc.collect()
out["del_no_deadline"] = time.monotonic() - t0
# the worker processes' decoder: the same (its loader's header pass gets no answer: threads)
whole = os.path.join(d, "whole.jsonl")  # no offsets (this decoder takes none)
with open(whole, "w") as f:
    f.writelines(line for line in open(m) if "offset" not in line)
feed = avpipe.recipes.rnnt_feed(whole, batch_size=2, device="cpu", training=False,
                                shuffle=False, threads=2, decoder="processes")
t0 = time.monotonic()
n = sum(len(b.paths) for b in feed)
out["processes"] = [n, time.monotonic() - t0,
                    [(os.path.basename(p), e.split(":")[0]) for p, e in feed.errors]]
print(json.dumps(out), flush=True)
print(time.time(), flush=True)
"""


def _run_until_exit(script, args, hook, env=None, timeout=90):
    """Run ``script``; its last line is the time it finished its work: returns (JSON of the line
    before, seconds from that time to the process's exit)."""
    import json
    import subprocess
    import sys
    import time

    root = REPO
    env = {**os.environ, "PYTHONPATH": hook + os.pathsep + root, "AVPIPE_DISABLE_GPU": "1",
           **(env or {})}
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=timeout, cwd=root, env=env)
    gone = time.time()
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-2]), gone - float(lines[-1])


def test_feed_item_whose_read_never_returns_costs_the_item_not_the_process(tmp_path):
    """A "regular" file whose read never returns (a stalled network mount; here a named pipe
    taken for a file) is skipped as a DecodeTimeoutError past the feed's default deadline,
    each epoch; neither the next epoch, ``del feed`` (with or without a deadline) nor the
    interpreter's exit waits for the thread stuck in it. In a subprocess: the feed and its
    exit are what is timed."""
    from stalls import pipes_read_as_files

    d = tmp_path / "in"
    d.mkdir()
    out, exit_s = _run_until_exit(_STUCK_FEED, [str(d)], pipes_read_as_files(tmp_path),
                                  env={"AVPIPE_FEED_DEADLINE": "1"})
    for epoch in ("epoch0", "epoch1"):
        n, seconds, errors = out[epoch]
        # the three stuck items (one file): reported in the epoch's batches (a batch lists
        # each (path, message) once), the three good ones decoded
        assert n == 3 and {tuple(e) for e in errors} == {("stuck.wav", "DecodeTimeoutError")}
        assert seconds < 1 + 5, out
    assert out["del"] < 1 and out["del_no_deadline"] < 1, out
    n, seconds, errors = out["processes"]
    assert n == 3 and {tuple(e) for e in errors} == {("stuck.wav", "DecodeTimeoutError")}, out
    assert seconds < 2 * (1 + 5), out  # the header pass's wait, then the item's deadline
    assert exit_s < 5, (exit_s, out)


_STUCK_EXTRACT = r"""
import hashlib, json, os, shutil, subprocess, sys, time
d, samples, out, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# a "regular" file here (pipes_read_as_files); not the first video, whose wait has more time
# (the decoders start then)
os.mkfifo(os.path.join(d, "w_stuck.mp4"))
shutil.copy(os.path.join(samples, "speech", "utt01.wav"), os.path.join(d, "a.wav"))
shutil.copy(os.path.join(samples, "video", "circles_h264.mp4"), os.path.join(d, "v.mp4"))
shutil.copy(os.path.join(samples, "images", "scene.jpg"), os.path.join(d, "i.jpg"))
cmd = [sys.executable, "-m", "avpipe", "extract", d, "--preset", "quickstart", "--out", out,
       "--device", "cpu", *extra]
res = {}
for run in ("first", "again"):
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            f = os.path.join(root, n)
            # the shards themselves are not rewritten; every file keeps its bytes
            files[os.path.relpath(f, out)] = [
                hashlib.sha256(open(f, "rb").read()).hexdigest(),
                os.stat(f).st_mtime_ns if f.endswith(".tar") else 0]
    errors = sorted((os.path.basename(r["source"]), r["error"]) for r in
                    map(json.loads, open(os.path.join(out, "errors.jsonl"))))
    status = sorted((r["source"], r["status"]) for r in
                    map(json.loads, open(os.path.join(out, "index.jsonl"))))
    res[run] = [p.returncode, time.monotonic() - t0, errors, files, p.stderr[-2000:], status]
print(json.dumps(res), flush=True)
print(time.time(), flush=True)
"""


def test_extract_input_whose_read_never_returns_is_a_timeout_error(tmp_path):
    """``avpipe extract`` over an input whose read never returns (a video): its worker is
    replaced past ``AVPIPE_EXTRACT_FILE_TIMEOUT``, it is listed in
    errors.jsonl as DecodeTimeoutError, the other inputs are written, the run exits 0, and a
    rerun rewrites nothing."""
    from stalls import pipes_read_as_files

    d = tmp_path / "in"
    d.mkdir()
    root = REPO
    out, exit_s = _run_until_exit(
        _STUCK_EXTRACT, [str(d), os.path.join(root, "samples"), str(tmp_path / "out")],
        pipes_read_as_files(tmp_path), env={"AVPIPE_EXTRACT_FILE_TIMEOUT": "1"}, timeout=280)
    code, seconds, errors, files, stderr, status = out["first"]
    assert code == 0, stderr
    assert errors == [["w_stuck.mp4", "DecodeTimeoutError"]], stderr
    assert status == [["a.wav", "ok"], ["i.jpg", "ok"], ["v.mp4", "ok"],
                      ["w_stuck.mp4", "error"]], status
    assert len([f for f in files if f.endswith(".tar")]) >= 1
    code2, _, errors2, files2, stderr2, _ = out["again"]
    assert code2 == 0 and errors2 == errors and files2 == files, stderr2
    assert exit_s < 5


@pytest.mark.slow
def test_extract_ray_input_whose_read_never_returns_is_a_timeout_error(tmp_path):
    """``avpipe extract --engine ray``, as the local engine above: the input whose read never
    returns is a DecodeTimeoutError row in errors.jsonl past ``AVPIPE_EXTRACT_FILE_TIMEOUT``
    (the actor gives up the thread stuck in it and computes the rest of the shard again), the
    other inputs are written, and a rerun rewrites nothing."""
    pytest.importorskip("ray.data")
    from stalls import pipes_read_as_files

    d = tmp_path / "in"
    d.mkdir()
    root = REPO
    out, _ = _run_until_exit(
        _STUCK_EXTRACT, [str(d), os.path.join(root, "samples"), str(tmp_path / "out"),
                         "--engine", "ray"],
        pipes_read_as_files(tmp_path), env={"AVPIPE_EXTRACT_FILE_TIMEOUT": "1"}, timeout=400)
    code, seconds, errors, files, stderr, status = out["first"]
    assert code == 0, stderr
    assert errors == [["w_stuck.mp4", "DecodeTimeoutError"]], stderr
    assert status == [["a.wav", "ok"], ["i.jpg", "ok"], ["v.mp4", "ok"],
                      ["w_stuck.mp4", "error"]], status
    code2, _, errors2, files2, stderr2, _ = out["again"]
    assert code2 == 0 and errors2 == errors and files2 == files, stderr2


_STUCK_VIDEO_FEED = r"""
import gc, json, os, shutil, sys, time
import avpipe
d, samples = sys.argv[1], sys.argv[2]
os.mkfifo(os.path.join(d, "stuck.mp4"))  # a "regular" file here (pipes_read_as_files)
with open(os.path.join(d, "list.csv"), "w") as f:
    f.write("path,label\n")
    for i in range(3):
        shutil.copy(os.path.join(samples, "video", "circles_h264.mp4"),
                    os.path.join(d, f"v{i}.mp4"))
        f.write(f"v{i}.mp4,{i % 2}\n")
    f.write("stuck.mp4,1\n")
with avpipe.VideoDecoder(os.path.join(d, "v0.mp4"), device="cpu") as dec:
    dec.get_frames([0, 1])  # the decoders' first use (imports, libraries): not an item's time
feed = avpipe.recipes.video_classification(os.path.join(d, "list.csv"), clip_length=2,
                                           stride=1, crop_size=32, batch_size=2, device="cpu",
                                           threads=2, dtype="float32")
out = {}
for epoch in range(2):
    t0 = time.monotonic()
    n, errs = 0, []
    for b in feed:  # each batch carries the errors of the items skipped while making it
        n += len(b.paths)
        errs += b.errors
    out[f"epoch{epoch}"] = [n, time.monotonic() - t0,
                            [(os.path.basename(p), e.split(":")[0]) for p, e in errs]]
t0 = time.monotonic()
del feed
gc.collect()
out["del"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
print(time.time(), flush=True)
"""


def test_video_feed_item_whose_read_never_returns_costs_the_item_not_the_process(tmp_path):
    """The video feed, as the RNN-T feed above: the stuck video is a DecodeTimeoutError past
    the default deadline in each epoch, and nothing waits for its threads (the decoding
    thread, the scan-ahead process reading its sample tables) at ``del feed`` or exit."""
    from stalls import pipes_read_as_files

    d = tmp_path / "in"
    d.mkdir()
    root = REPO
    out, exit_s = _run_until_exit(_STUCK_VIDEO_FEED, [str(d), os.path.join(root, "samples")],
                                  pipes_read_as_files(tmp_path),
                                  env={"AVPIPE_FEED_DEADLINE": "2"})
    for epoch in ("epoch0", "epoch1"):
        n, seconds, errors = out[epoch]
        # a training feed: the stuck video's place filled by a repeat (batches stay full)
        assert n == 4 and errors == [["stuck.mp4", "DecodeTimeoutError"]], out
        assert seconds < 2 + 5, out
    assert out["del"] < 1, out
    assert exit_s < 5, (exit_s, out)


def test_feed_deadline_option_and_setting(monkeypatch, tmp_path):
    """``deadline="auto"`` (the recipes' default) is ``AVPIPE_FEED_DEADLINE`` (60 s unset; 0:
    no limit); a number is used as given, None or 0 turn it off, anything else is a
    ValueError naming the option and the value."""
    from avpipe import settings
    from avpipe.pipeline.feed import resolve_deadline

    monkeypatch.delenv("AVPIPE_FEED_DEADLINE", raising=False)
    assert resolve_deadline("auto") == settings.FEED_DEADLINE_S == 60.0
    monkeypatch.setenv("AVPIPE_FEED_DEADLINE", "2.5")
    assert resolve_deadline("auto") == 2.5
    monkeypatch.setenv("AVPIPE_FEED_DEADLINE", "0")
    assert resolve_deadline("auto") is None
    assert resolve_deadline(None) is None and resolve_deadline(0) is None
    assert resolve_deadline(3) == 3.0
    for bad in (-1, "soon", True):
        with pytest.raises(ValueError, match="deadline") as ei:
            resolve_deadline(bad)
        assert repr(bad) in str(ei.value) or str(bad) in str(ei.value)
    monkeypatch.setenv("AVPIPE_FEED_DEADLINE", "later")
    with pytest.raises(ValueError, match="AVPIPE_FEED_DEADLINE"):
        resolve_deadline("auto")
    monkeypatch.setenv("AVPIPE_FEED_DEADLINE", "7")
    sf.write(tmp_path / "a.wav", np.zeros(160, np.float32), SR)
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 0.01}\n')
    feed = avpipe.recipes.rnnt_feed(tmp_path / "m.jsonl", batch_size=1, device="cpu")
    assert feed.task.deadline == 7.0
    feed = avpipe.recipes.rnnt_feed(tmp_path / "m.jsonl", batch_size=1, device="cpu",
                                    deadline=None)
    assert feed.task.deadline is None


def test_abandonable_pool_threads_are_not_joined_and_end_when_dropped():
    """The feeds' decoding threads: daemon threads outside concurrent.futures' exit join;
    a pool shut down or dropped lets its idle threads end; a call running when the pool is
    shut down is not waited for."""
    import concurrent.futures.thread as cft
    import gc
    import threading
    import time

    from avpipe.pipeline._threads import AbandonablePool

    pool = AbandonablePool(2, "t")
    release = threading.Event()
    stuck = pool.submit(release.wait)
    assert pool.submit(lambda: 5).result(timeout=10) == 5
    ts = pool.threads
    assert all(t.daemon for t in ts) and not set(ts) & set(cft._threads_queues)
    queued = [pool.submit(time.sleep, 0) for _ in range(3)]
    t0 = time.monotonic()
    pool.shutdown(wait=True, cancel_futures=True)
    assert time.monotonic() - t0 < 1 and not stuck.done()
    assert all(f.cancelled() or f.done() for f in queued)
    with pytest.raises(RuntimeError):
        pool.submit(lambda: 1)
    release.set()
    for t in ts:
        t.join(timeout=10)
        assert not t.is_alive()
    pool = AbandonablePool(2, "t")
    assert pool.submit(lambda: 1).result(timeout=10) == 1
    ts = pool.threads
    del pool
    gc.collect()
    for t in ts:
        t.join(timeout=10)
        assert not t.is_alive()


def test_extract_audio_probe_gives_up_a_read_that_never_returns(tmp_path, monkeypatch):
    """Extraction reads every audio file's header before routing it: a header read that never
    returns gives no probe after ``AVPIPE_EXTRACT_FILE_TIMEOUT`` (the file goes the one-by-one
    way, whose wait the worker's watchdog times) instead of holding the worker's set-up, and
    the other files' probes are not held behind it (soundfile opens files under one lock)."""
    import threading
    import time

    from avpipe.pipeline.sources import Item
    from avpipe.recipes.extract._process import _probe_all

    good = tmp_path / "a.wav"
    sf.write(good, np.zeros(800, np.float32), SR)
    stuck = tmp_path / "stuck.wav"
    os.mkfifo(stuck)  # libsndfile's open blocks until a writer comes
    monkeypatch.setenv("AVPIPE_EXTRACT_FILE_TIMEOUT", "1")
    items = [Item(index=i, path=str(p), kind="audio", source=p.name, fields={})
             for i, p in enumerate((stuck, good, good))]  # the stuck one starts first
    got = []
    t = threading.Thread(target=lambda: got.append(_probe_all(items)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout=20)
    try:
        assert got and time.monotonic() - t0 < 10
        assert got[0] == [None, (800, SR, "PCM_16", 1), (800, SR, "PCM_16", 1)], got
    finally:  # let the abandoned read end: a writer comes, the pipe goes (the probe's next
        # open, soundfile's, then fails at once instead of blocking under soundfile's lock)
        fd = os.open(stuck, os.O_WRONLY | os.O_NONBLOCK)
        os.unlink(stuck)
        os.close(fd)
        for th in threading.enumerate():
            if th.name.startswith("avpipe-extract-probe"):
                th.join(timeout=10)
                assert not th.is_alive()


_STUCK_IMAGE_FEED = r"""
import gc, json, os, shutil, sys, time
import avpipe
d, samples = sys.argv[1], sys.argv[2]
os.mkfifo(os.path.join(d, "stuck.jpg"))  # a "regular" file here (pipes_read_as_files)
with open(os.path.join(d, "list.csv"), "w") as f:
    f.write("path,label\n")
    for i in range(5):
        shutil.copy(os.path.join(samples, "images", "scene.jpg"), os.path.join(d, f"i{i}.jpg"))
        f.write(f"i{i}.jpg,{i % 2}\n")
    f.write("stuck.jpg,1\n")
feed = avpipe.recipes.image_classification(os.path.join(d, "list.csv"), batch_size=2,
                                           crop_size=32, resize_size=40, device="cpu",
                                           train=False, dtype="float32")
out = {}
for epoch in range(2):
    t0 = time.monotonic()
    n, errs = 0, []
    for b in feed:  # each batch carries the errors of the items skipped while making it
        n += len(b.paths)
        errs += b.errors
    out[f"epoch{epoch}"] = [n, time.monotonic() - t0,
                            [(os.path.basename(p), e.split(":")[0]) for p, e in errs]]
t0 = time.monotonic()
del feed
gc.collect()
out["del"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
print(time.time(), flush=True)
"""


def test_image_feed_item_whose_read_never_returns_costs_the_item_not_the_process(tmp_path):
    """The image feed reads each batch's files on its decoding threads: a file whose read
    never returns is a DecodeTimeoutError past the feed's deadline in each epoch (not a hung
    epoch), the other images are decoded, and neither ``del feed`` nor the exit waits for the
    thread stuck in the read."""
    from stalls import pipes_read_as_files

    d = tmp_path / "in"
    d.mkdir()
    root = REPO
    out, exit_s = _run_until_exit(_STUCK_IMAGE_FEED, [str(d), os.path.join(root, "samples")],
                                  pipes_read_as_files(tmp_path),
                                  env={"AVPIPE_FEED_DEADLINE": "2"})
    for epoch in ("epoch0", "epoch1"):
        n, seconds, errors = out[epoch]
        assert n == 5 and errors == [["stuck.jpg", "DecodeTimeoutError"]], out
        assert seconds < 2 + 5, out
    assert out["del"] < 1, out
    assert exit_s < 5, (exit_s, out)


_STUCK_FLAC_WINDOW = r"""
import json, os, sys, threading, time, types
import numpy as np


class _Stream:  # what GpuFlacBatches.run touches of CuPy before its first window is read
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


sys.modules["cupy"] = types.SimpleNamespace(
    cuda=types.SimpleNamespace(Stream=_Stream, get_current_stream=_Stream))
from avpipe.pipeline._flac_windows import GpuFlacBatches

stuck = os.path.join(sys.argv[1], "stuck.flac")
os.mkfifo(stuck)  # opening it blocks: no writer comes
b = GpuFlacBatches({stuck: 4096}, max_samples=1000, readers="threads", read_threads=2,
                   prefetch=1)
b._buffer = lambda k, n: np.zeros(n, np.uint8)  # no page-locked memory without a GPU
t = threading.Thread(target=lambda: list(b.run([[stuck]])), daemon=True)
t.start()
time.sleep(1)
print(json.dumps({"running": t.is_alive(), "readers": sorted(
    th.name.rsplit("_", 1)[0] for th in threading.enumerate()
    if th.name.startswith("avpipe-flac"))}), flush=True)
print(time.time(), flush=True)
"""


def test_gpu_flac_window_read_that_never_returns_does_not_hold_exit(tmp_path):
    """The GPU FLAC loader reads its windows' files on threads nothing joins: a read that
    never returns holds its thread (and the run waiting on it), never the interpreter's exit.
    On the CPU: the run's reading part, with CuPy's few calls before it stubbed."""
    out, exit_s = _run_until_exit(_STUCK_FLAC_WINDOW, [str(tmp_path)], "", timeout=30)
    assert out["running"] and "avpipe-flac-read" in out["readers"], out
    assert exit_s < 5, (exit_s, out)


_STUCK_ORDERED_MAP = r"""
import json, threading, time
from avpipe.recipes.extract._process import _ordered_map

never = threading.Event()


def fn(x):
    if x == 1:  # a read that never returns
        never.wait()
    return x


results = _ordered_map(fn, [0, 1, 2, 3], 2)
first = next(results)
time.sleep(0.5)  # the consumer gives up on item 1 (the Ray engine's watch) and moves on
print(json.dumps({"first": first}), flush=True)
print(time.time(), flush=True)
"""


def test_extract_ordered_map_thread_stuck_in_a_read_does_not_hold_exit(tmp_path):
    """Extraction's decode-ahead threads (videos, audio one by one) are daemon threads nothing
    joins: one stuck in a read that never returns (given up by the Ray engine's watch) does
    not hold the process's exit."""
    out, exit_s = _run_until_exit(_STUCK_ORDERED_MAP, [], "", timeout=30)
    assert out["first"] == 0
    assert exit_s < 5, (exit_s, out)
