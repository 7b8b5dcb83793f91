"""avpipe.load_audio: formats, offset/duration, channels, resampling, bad input."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from stalls import let_loader_read_pipes

import avpipe
from avpipe.decoding.audio import Audio, audio_info, load_audio

sf = pytest.importorskip("soundfile")

SR = 16000


def _tone(n, sr, freq=440.0, channels=1, amp=0.5):
    t = np.arange(n) / sr
    x = np.stack([amp * np.sin(2 * np.pi * freq * (c + 1) * t) for c in range(channels)], axis=1)
    return x.astype(np.float32)


@pytest.mark.parametrize("subtype,dtype,scale", [("PCM_16", np.int16, 2 ** 15), ("PCM_24", np.int32, 2 ** 31),
                                                 ("PCM_32", np.int32, 2 ** 31), ("FLOAT", None, 1)])
def test_wav_pcm_roundtrip_bit_exact(tmp_path, subtype, dtype, scale):
    rng = np.random.default_rng(0)
    x = rng.uniform(-0.9, 0.9, size=(5000, 2)).astype(np.float32)
    p = tmp_path / f"a_{subtype}.wav"
    sf.write(p, x, SR, subtype=subtype)
    want, _ = sf.read(p, dtype="float32", always_2d=True)   # soundfile's own decoded values
    a = load_audio(p, mono=False)
    assert isinstance(a, Audio) and a.sample_rate == SR and a.samples.dtype == np.float32
    assert a.samples.shape == (2, 5000)
    np.testing.assert_array_equal(a.samples, want.T)
    if dtype is not None:   # and those are the written integers / 2^(bits-1)
        ints, _ = sf.read(p, dtype="int32" if dtype == np.int32 else "int16", always_2d=True)
        np.testing.assert_array_equal(a.samples, (ints.astype(np.float64) / scale).T.astype(np.float32))
    m = load_audio(p)
    np.testing.assert_allclose(m.samples, want.mean(axis=1), atol=1e-7)
    c1 = load_audio(p, channel=1)
    np.testing.assert_array_equal(c1.samples, want[:, 1])


def test_flac_and_mono_shapes(tmp_path):
    x = _tone(8000, SR)
    p = tmp_path / "a.flac"
    sf.write(p, x, SR, subtype="PCM_16")
    want, _ = sf.read(p, dtype="float32")
    a = load_audio(str(p))
    assert a.samples.shape == (8000,)
    np.testing.assert_array_equal(a.samples, want)
    b = load_audio(p, mono=False)
    assert b.samples.shape == (1, 8000)
    # bytes and file objects
    data = p.read_bytes()
    np.testing.assert_array_equal(load_audio(data).samples, want)
    np.testing.assert_array_equal(load_audio(io.BytesIO(data)).samples, want)
    assert audio_info(p)["frames"] == 8000


def test_ogg_vorbis_within_codec_tolerance(tmp_path):
    x = _tone(SR, SR, freq=440.0)
    p = tmp_path / "a.ogg"
    try:
        sf.write(p, x, SR, format="OGG", subtype="VORBIS")
    except Exception as e:  # pragma: no cover - libsndfile without vorbis
        pytest.skip(f"no OGG/Vorbis in libsndfile: {e}")
    a = load_audio(p)
    assert abs(a.samples.shape[0] - SR) <= 2048
    n = min(SR, a.samples.shape[0])
    err = a.samples[1000:n - 1000] - x[1000:n - 1000, 0]
    assert np.sqrt(np.mean(err ** 2)) < 0.02
    assert abs(np.sqrt(np.mean(a.samples[1000:n - 1000] ** 2)) - 0.5 / np.sqrt(2)) < 0.02


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_offset_duration_equal_slices(tmp_path, fmt):
    rng = np.random.default_rng(1)
    x = rng.uniform(-0.5, 0.5, size=(SR * 2, 2)).astype(np.float32)
    p = tmp_path / f"a.{fmt}"
    sf.write(p, x, SR, subtype="PCM_16")
    full = load_audio(p, mono=False).samples
    for off, dur in [(0.0, 0.5), (0.25, 0.5), (0.123456, 0.333333), (1.5, None), (1.9, 5.0)]:
        a = load_audio(p, mono=False, offset=off, duration=dur)
        s = int(round(off * SR))
        e = None if dur is None else s + int(round(dur * SR))
        np.testing.assert_array_equal(a.samples, full[:, s:e])
        assert a.offset_samples == s
    with pytest.raises(ValueError, match="offset"):
        load_audio(p, offset=3.0)
    with pytest.raises(ValueError, match="offset"):
        load_audio(p, offset=-1)
    with pytest.raises(ValueError, match="duration"):
        load_audio(p, duration=float("nan"))


def test_video_container_audio_track(tmp_path):
    av = pytest.importorskip("av")
    p = tmp_path / "v.mkv"
    sr, n = 16000, 16000
    x = _tone(n, sr, freq=300.0, channels=2)
    with av.open(str(p), "w") as out:
        vs = out.add_stream("mpeg4", rate=10)
        vs.width, vs.height, vs.pix_fmt = 64, 48, "yuv420p"
        st = out.add_stream("pcm_s16le", rate=sr, layout="stereo")
        for _ in range(10):
            f = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
            for pkt in vs.encode(f):
                out.mux(pkt)
        ints = (x * 32767).astype(np.int16)
        for s in range(0, n, 1600):
            fr = av.AudioFrame.from_ndarray(np.ascontiguousarray(ints[s:s + 1600].reshape(1, -1)),
                                            format="s16", layout="stereo")
            fr.sample_rate = sr
            fr.pts = s
            for pkt in st.encode(fr):
                out.mux(pkt)
        for pkt in list(vs.encode(None)) + list(st.encode(None)):
            out.mux(pkt)
    a = load_audio(p, mono=False)
    assert a.sample_rate == sr and a.samples.shape == (2, n)
    np.testing.assert_allclose(a.samples, (x * 32767).astype(np.int16).T / 32768.0, atol=1e-6)
    part = load_audio(p, mono=False, offset=0.25, duration=0.5)
    np.testing.assert_array_equal(part.samples, a.samples[:, 4000:12000])
    r = load_audio(p, sample_rate=8000)
    assert r.sample_rate == 8000 and r.samples.shape == (8000,)


@pytest.mark.parametrize("orig", [44100, 8000])
def test_resample_on_load_keeps_tone(tmp_path, orig):
    n = orig * 2
    x = _tone(n, orig, freq=1000.0, amp=0.5)
    p = tmp_path / f"t{orig}.wav"
    sf.write(p, x, orig, subtype="FLOAT")
    a = load_audio(p, sample_rate=16000)
    assert a.sample_rate == 16000 and a.source_sample_rate == orig
    assert a.samples.shape == (-(-n * 16000 // orig),)
    mid = a.samples[2000:-2000].astype(np.float64)
    assert abs(np.sqrt(np.mean(mid ** 2)) / (0.5 / np.sqrt(2)) - 1) < 0.01
    spec = np.abs(np.fft.rfft(mid * np.hanning(len(mid)), n=16 * len(mid)))
    assert abs(np.argmax(spec) * 16000 / (16 * len(mid)) - 1000.0) < 1.0


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_audio(tmp_path / "missing.wav")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"this is not audio at all" * 50)
    with pytest.raises(avpipe.DecodeError) as ei:
        load_audio(junk)
    assert str(junk) in str(ei.value)
    with pytest.raises(avpipe.DecodeError, match="<bytes>"):
        load_audio(b"\x00\x01garbage" * 100)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(avpipe.EmptyMediaError, match="empty.wav"):
        load_audio(empty)
    nosamples = tmp_path / "zero.wav"
    sf.write(nosamples, np.zeros((0, 1), np.float32), SR)
    with pytest.raises(avpipe.EmptyMediaError, match="zero.wav"):
        load_audio(nosamples)
    nan = tmp_path / "nan.wav"
    y = np.zeros(1000, np.float32)
    y[500] = np.nan
    sf.write(nan, y, SR, subtype="FLOAT")
    with pytest.raises(avpipe.CorruptDataError, match="nan.wav"):
        load_audio(nan)
    with pytest.raises(ValueError, match="sample_rate"):
        load_audio(nan, sample_rate=0)
    with pytest.raises(ValueError, match="channel"):
        load_audio(nosamples, channel=-1)


def test_truncated_flac_is_typed_error(tmp_path):
    p = tmp_path / "t.flac"
    sf.write(p, _tone(SR, SR), SR, subtype="PCM_16")
    data = p.read_bytes()
    bad = tmp_path / "cut.flac"
    bad.write_bytes(data[:60])
    with pytest.raises(avpipe.DecodeError, match="cut.flac"):
        load_audio(bad)


def test_public_names():
    assert avpipe.load_audio is load_audio and avpipe.Audio is Audio


def test_batch_loader_cpu_matches_soundfile(tmp_path):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    rng = np.random.default_rng(3)
    paths, want = [], []
    for i, n in enumerate([3000, 8000, 1234, 5000, 4321]):
        x = rng.uniform(-0.5, 0.5, n).astype(np.float32)
        p = tmp_path / f"u{i}.flac"
        sf.write(p, x, SR, subtype="PCM_16")
        paths.append(p)
        want.append(sf.read(p, dtype="float32")[0])
    bad = tmp_path / "bad.flac"
    bad.write_bytes(b"nope" * 100)
    with AudioBatchLoader(paths + [bad], batch_size=4, num_workers=2, prefetch=2, device="cpu") as loader:
        assert loader.sample_rate == SR
        got = list(loader.batches(epochs=2))
    assert len(got) == 4
    for e in range(2):
        (x0, l0, _, err0), (x1, l1, _, err1) = got[2 * e], got[2 * e + 1]
        assert x0.shape == (4, 8000) and l0.tolist() == [3000, 8000, 1234, 5000] and not err0
        for i in range(4):
            np.testing.assert_array_equal(x0[i, :l0[i]], want[i])
            assert np.all(x0[i, l0[i]:] == 0)
        assert l1.tolist() == [4321, 0] and [i for i, _ in err1] == [1]
        assert isinstance(err1[0][1], avpipe.DecodeError) and "bad.flac" in str(err1[0][1])
        np.testing.assert_array_equal(x1[0, :4321], want[4])


def test_batch_loader_never_hangs_on_a_stuck_decoder(tmp_path, monkeypatch):
    """A decoder that never returns (here: a FIFO nobody writes) costs its item, not the run."""
    import os
    import time

    from avpipe.pipeline.audio_loader import AudioBatchLoader

    good = []
    for i in range(3):
        p = tmp_path / f"g{i}.flac"
        sf.write(p, np.full(800 + i, 0.25, np.float32), SR, subtype="PCM_16")
        good.append(p)
    stuck = tmp_path / "stuck.flac"
    os.mkfifo(stuck)
    let_loader_read_pipes(monkeypatch, tmp_path)
    paths = [good[0], stuck, good[1], good[2]]
    t0 = time.monotonic()
    with AudioBatchLoader(paths, batch_size=2, num_workers=2, prefetch=2, device="cpu",
                          max_samples=1000, timeout=2.0) as loader:  # fmt: skip
        got = list(loader.batches(epochs=1))
    assert time.monotonic() - t0 < 30
    (x0, l0, _, e0), (x1, l1, _, e1) = got
    assert [i for i, _ in e0] == [1] and "no answer" in str(e0[0][1]) and l0[1] == 0
    assert isinstance(e0[0][1], avpipe.DecodeTimeoutError)
    assert l0[0] == 800 and not e1 and l1.tolist() == [801, 802]  # the next batch still decodes
    np.testing.assert_allclose(x1[1, :802], 0.25, atol=1e-4)


def test_batch_loader_refuses_mixed_rates_and_reports_long_files(tmp_path):
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    sf.write(a, np.zeros(100, np.float32), SR)
    sf.write(b, np.zeros(100, np.float32), 8000)
    with pytest.raises(ValueError, match="paths must share one sample rate"):
        AudioBatchLoader([a, b], device="cpu", num_workers=1)
    long = tmp_path / "long.wav"
    sf.write(long, np.zeros(500, np.float32), SR)
    with AudioBatchLoader([a, long], batch_size=2, num_workers=1, device="cpu", max_samples=200) as L:
        (_, lengths, _, errors), = list(L.batches())
    assert lengths.tolist() == [100, 0] and "more than max_samples=200" in str(dict(errors)[1])


def test_batch_loader_decode_groups_cpu(tmp_path):
    from avpipe.pipeline.audio_loader import AudioBatch, AudioBatchLoader

    rng = np.random.default_rng(5)
    paths, want = [], []
    for i, n in enumerate([3000, 800, 1234, 5000, 4321, 77]):
        x = rng.uniform(-0.5, 0.5, n).astype(np.float32)
        p = tmp_path / f"u{i}.flac"
        sf.write(p, x, SR, subtype="PCM_16")
        paths.append(str(p))
        want.append(sf.read(p, dtype="float32")[0])
    bad = tmp_path / "bad.flac"
    bad.write_bytes(b"nope" * 100)
    paths.append(str(bad))
    groups = [[5, 0, 6], [3], [2, 2, 1, 4], [], [0]]
    with AudioBatchLoader(paths, batch_size=4, num_workers=2, prefetch=2, device="cpu") as L:
        got = list(L.decode_groups(iter(groups)))  # a lazy iterable is fine
        assert len(got) == len(groups)
        for g, b in zip(groups, got):
            assert isinstance(b, AudioBatch) and b.paths == [paths[i] for i in g]
            assert b.lengths.shape == (len(g),)
            for r, i in enumerate(g):
                if i == 6:
                    assert b.lengths[r] == 0 and [k for k, _ in b.errors] == [r]
                    continue
                n = len(want[i])
                assert b.lengths[r] == n
                np.testing.assert_array_equal(b.signals[r, :n], want[i])
                assert not np.any(b.signals[r, n:])
        with pytest.raises(ValueError, match="at most batch_size"):
            list(L.decode_groups([[0, 1, 2, 3, 4]]))
        # batches() is decode_groups over the file order
        a = [b.paths for b in L.batches()]
        assert a == [paths[:4], paths[4:]]


def test_flac_reader_processes_read_files_into_their_slots(tmp_path):
    """The GPU FLAC loader's reader processes map a function over items in order, put each
    file's bytes at its offset in the slot asked for, leave the other slots alone, and report a file that cannot be read (zeros
    in its place) or that shrank since it was listed (zeros past its end)."""
    from avpipe.pipeline._flac_windows import ProcessReaders

    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1000, 1, 4096, 777)]
    paths = []
    for k, b in enumerate(blobs):
        p = tmp_path / f"f{k}.bin"
        p.write_bytes(b)
        paths.append(str(p))
    sizes = [len(b) for b in blobs]
    sizes[3] += 23  # listed longer than it is now
    paths.insert(2, str(tmp_path / "missing.bin"))
    sizes.insert(2, 50)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    calls = []
    readers = ProcessReaders(2)
    procs = list(readers._state["procs"])
    try:
        assert readers.map(len, ["ab", "", "xyz"] * 50, chunksize=7) == [2, 0, 3] * 50
        readers.allocate(3, 8192, register=lambda views: calls.append(len(views)))
        for v in readers.views:
            v[:] = 7
        errors = readers.read(1, offsets, paths)
        assert calls == [3]
        assert set(errors) == {2} and "missing.bin" in errors[2]
        got = readers.views[1]
        for i, b in enumerate(blobs[:2] + [None] + blobs[2:]):
            a, e = int(offsets[i]), int(offsets[i + 1])
            if b is None:
                assert not got[a:e].any()
                continue
            assert got[a : a + len(b)].tobytes() == b
            assert not got[a + len(b) : e].any()  # the shrunken file's tail
        assert (got[int(offsets[-1]):] == 7).all()
        assert (readers.views[0] == 7).all() and (readers.views[2] == 7).all()
    finally:
        readers.close()
    assert not readers.alive and all(w.proc.poll() is not None for w in procs)  # all gone


def _readers_one_killed(tmp_path, *, files, size, timeout):
    """Two reader processes (``timeout``), a staging slot, the second process killed; ``files``
    files of ``size`` bytes (file k all k + 1) and their offsets back to back."""
    import signal

    from avpipe.pipeline._flac_windows import ProcessReaders

    paths = []
    for k in range(files):
        p = tmp_path / f"f{k}.bin"
        p.write_bytes(bytes([k + 1]) * size)
        paths.append(str(p))
    offsets = np.arange(0, (files + 1) * size, size, dtype=np.int64)
    readers = ProcessReaders(2, timeout=timeout)
    try:
        readers.allocate(1, 1024)
        os.kill(readers._state["procs"][1].pid, signal.SIGKILL)
        readers._state["procs"][1].proc.wait()
    except BaseException:
        readers.close()
        raise
    return readers, paths, offsets


def test_flac_reader_process_replaced_has_its_start_to_answer(tmp_path):
    """A reader process started in place of a lost one is not held to the request timeout
    while it starts (a fresh interpreter takes about 0.3 s): its first answer has the
    start's allowance (BOOT_S), as the first processes had; later ones the timeout."""
    readers, paths, offsets = _readers_one_killed(tmp_path, files=2, size=64, timeout=0.1)
    try:
        errors = readers.read(0, offsets, paths)
        assert set(errors) == {1}
        new = readers._state["procs"][1]
        assert not new.answered
        assert readers.read(0, offsets, paths) == {}  # the new process, on its first answer
        assert new.answered and readers._state["procs"][1] is new
        assert readers.views[0][:128].tolist() == [1] * 64 + [2] * 64
    finally:
        readers.close()


def test_flac_reader_processes_replace_a_dead_or_stuck_process(tmp_path):
    """A reader process that died or does not answer in time is replaced: its files are
    reported (read) or the call raises multiprocessing.TimeoutError (map), and the next calls
    are answered in full."""
    import multiprocessing as mp
    import time

    readers, paths, offsets = _readers_one_killed(tmp_path, files=4, size=100, timeout=0.5)
    try:
        errors = readers.read(0, offsets, paths)
        assert set(errors) == {2, 3} and all("died" in w or "gone" in w for w in errors.values())
        assert readers.read(0, offsets, paths) == {}
        assert readers.views[0][:400].tolist() == [1] * 100 + [2] * 100 + [3] * 100 + [4] * 100
        t0 = time.monotonic()
        with pytest.raises(mp.TimeoutError, match="within 0.5 s"):
            readers.map(time.sleep, [30, 0], chunksize=1)
        assert time.monotonic() - t0 < 10
        assert readers.map(len, ["ab", "c"], chunksize=1) == [2, 1]
        # a request that fails on this side (its second part cannot be pickled) leaves no
        # answer behind for the next one; an error in the process comes back as itself
        import pickle

        with pytest.raises((pickle.PicklingError, AttributeError)):
            readers.map(len, ["x"] * 4 + [lambda: 0] * 4, chunksize=4)
        assert readers.map(len, ["ab", "c"], chunksize=1) == [2, 1]
        with pytest.raises(TypeError):
            readers.map(len, [1, 2], chunksize=1)
        assert readers.map(len, ["abc"], chunksize=1) == [3]
    finally:
        readers.close()


def test_reader_processes_do_not_run_an_unguarded_script_again(tmp_path):
    """The reader processes are fresh interpreters that never import the caller's __main__: a
    script without an ``if __name__ == "__main__":`` guard runs once (with multiprocessing's
    fork server it ran again in every reader)."""
    from unguarded import top_level_runs

    assert top_level_runs(tmp_path, (
        "from avpipe.pipeline._flac_windows import ProcessReaders\n"
        "r = ProcessReaders(3)\n"
        "assert r.map(len, ['ab', 'c', ''], chunksize=1) == [2, 1, 0]\n"
        "r.close()\n"
        "print('ok')\n")) == 1


def _flac_with_total(data: bytes, total: int) -> bytes:
    """A FLAC file's bytes with STREAMINFO's sample count set to ``total`` (0: unknown, as a
    stream written to a pipe has it)."""
    b = bytearray(data)
    assert b[:4] == b"fLaC" and b[4] & 0x7F == 0
    at = 8 + 10
    v = int.from_bytes(b[at : at + 8], "big")
    v = (v & ~((1 << 36) - 1)) | total
    b[at : at + 8] = v.to_bytes(8, "big")
    return bytes(b)


def test_gpu_loader_header_pass_reads_frames_rate_channels_and_size(tmp_path):
    """What the GPU FLAC loader's header pass gives per file: frames, rate, channels (the FLAC
    header's), the size on disk, why the CPU decodes it (None: the GPU may); (-1, 0, 0) and
    size 0 for a file that is not there. A streamed FLAC (STREAMINFO count 0) has the count
    its frames hold and goes to the CPU; so does one whose count its frames contradict."""
    import soundfile as sf

    from avpipe.pipeline._flac_windows import ProcessReaders
    from avpipe.pipeline.audio_loader import _header_and_size

    p = tmp_path / "a.flac"
    sf.write(p, np.zeros((1234, 2), np.float32), 22050, subtype="PCM_16")
    streamed, lying = tmp_path / "s.flac", tmp_path / "l.flac"
    streamed.write_bytes(_flac_with_total(p.read_bytes(), 0))
    lying.write_bytes(_flac_with_total(p.read_bytes(), 100))
    size = os.path.getsize(p)
    got = [_header_and_size(str(q)) for q in (streamed, lying)]
    assert got[0][:4] == (1234, 22050, 2, size) and "sample count" in got[0][4]
    assert got[1][:4] == (-1, 0, 0, size) or got[1][0] == 1234
    assert "declares 100 samples" in got[1][4]
    want = [(1234, 22050, 2, size, None), (-1, 0, 0, 0, None)]
    paths = [str(p), str(tmp_path / "missing.flac")]
    assert [_header_and_size(q) for q in paths] == want
    readers = ProcessReaders(2)
    try:  # the same in the reader processes
        assert readers.map(_header_and_size, paths, chunksize=1) == want
    finally:
        readers.close()


def test_batch_loader_run_left_early_never_writes_into_the_next_runs_batches(tmp_path,
                                                                            monkeypatch):
    """A consumer that stops early leaves work in flight, writing into the ring's slots: the
    next run waits for that work before it reuses its slot (a late write would overwrite the
    new batch's rows). Here the work in flight reads a pipe that is fed 1 s later."""
    import threading
    import time

    from avpipe.pipeline.audio_loader import AudioBatchLoader

    files = []
    for i in range(3):
        p = tmp_path / f"g{i}.wav"
        sf.write(p, np.full(800 + i, 0.1 * (i + 1), np.float32), SR, subtype="FLOAT")
        files.append(str(p))
    late = tmp_path / "late.wav"
    os.mkfifo(late)
    let_loader_read_pipes(monkeypatch, tmp_path)
    wav = io.BytesIO()
    sf.write(wav, np.full(900, 0.9, np.float32), SR, format="WAV", subtype="FLOAT")
    fed = []

    def feed_the_pipe():
        time.sleep(1.0)
        with open(late, "wb") as f:
            f.write(wav.getvalue())
        fed.append(time.monotonic())

    paths = [files[0], files[1], str(late), files[2]]
    with AudioBatchLoader(paths, batch_size=2, num_workers=2, prefetch=2, device="cpu",
                          max_samples=1000, timeout=30.0) as loader:  # fmt: skip
        first = loader.decode_groups([[0, 1], [2, 3]])
        next(first)  # the second batch ([late, g2]: slot 1) is in flight, blocked on the pipe
        first.close()
        writer = threading.Thread(target=feed_the_pipe)
        writer.start()
        got = []
        for x, lengths, _, errors in loader.decode_groups([[0, 1], [3, 3]]):
            got.append((time.monotonic(), np.array(x), lengths.tolist(), errors))
        writer.join()
    (_, x0, l0, e0), (t1, x1, l1, e1) = got
    assert not e0 and not e1 and l0 == [800, 801] and l1 == [802, 802]
    assert t1 >= fed[0]  # slot 1's batch came after the late write had landed
    np.testing.assert_allclose(x1[:, :802], 0.3, atol=1e-4)


@pytest.mark.parametrize("subtype", ["FLOAT", "DOUBLE"])
def test_batch_loader_int16_transport_scales_float_files(tmp_path, subtype):
    """libsndfile reads a float file as int16 unscaled (0.3 became 0: silence, no error); the
    loader's int16 ring now gets it scaled, within one int16 step of soundfile's float read."""
    from avpipe.pipeline.audio_loader import AudioBatchLoader

    t = np.arange(4000) / SR
    p = tmp_path / "f.wav"
    sf.write(p, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), SR, subtype=subtype)
    want = sf.read(p, dtype="float32")[0]
    with AudioBatchLoader([p], batch_size=1, num_workers=1, device="cpu",
                          transport="int16") as loader:  # fmt: skip
        ((x, lengths, _, errors),) = list(loader.batches())
    assert not errors and lengths.tolist() == [4000]
    np.testing.assert_allclose(x[0], want, atol=1.0 / 32768 + 1e-7)


@pytest.mark.parametrize("call", ["load_audio", "audio_info"])
def test_a_stuck_read_blocks_only_its_own_thread(tmp_path, monkeypatch, call):
    """``load_audio`` / ``audio_info`` of a path read its first byte in Python before
    soundfile opens it: a read that never returns (a stalled mount; here a named pipe with
    no writer, taken for a non-empty regular file) blocks its own thread there, not inside
    soundfile's open, and ``load_audio`` of a good file in another thread goes on."""
    import threading
    import time

    import avpipe._source as source_mod
    import avpipe.decoding.audio as audio_mod

    good = tmp_path / "good.wav"
    sf.write(good, np.full(800, 0.25, np.float32), SR)
    stuck = tmp_path / "stuck.wav"
    os.mkfifo(stuck)
    real_regular, real_size = source_mod.is_regular_file, os.path.getsize
    monkeypatch.setattr(source_mod, "is_regular_file",
                        lambda p: os.path.samefile(p, stuck) or real_regular(p))
    monkeypatch.setattr(os.path, "getsize",
                        lambda p: 1000 if os.path.samefile(p, stuck) else real_size(p))
    started = threading.Event()
    fn = getattr(audio_mod, call)

    def run():
        started.set()
        try:
            fn(str(stuck))
        except Exception:  # noqa: BLE001 - the pipe's content, once released
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait()
    time.sleep(0.5)  # the stuck call is inside its read
    try:
        got = []
        other = threading.Thread(target=lambda: got.append(load_audio(str(good))),
                                 daemon=True)
        other.start()
        other.join(timeout=10)
        assert got and got[0].samples.shape == (800,), "a good load waited for the stuck one"
        assert t.is_alive()  # still stuck in its own read
    finally:  # writers come and go until the stuck call has read the pipe's end and failed
        end = time.monotonic() + 10
        while t.is_alive() and time.monotonic() < end:
            try:
                os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader at this moment
                pass
            t.join(timeout=0.05)
        assert not t.is_alive()
