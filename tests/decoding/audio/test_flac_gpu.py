"""FLAC decoded on the GPU equals libFLAC's decode bit for bit, and the batch loader's GPU
decoder returns exactly what its CPU decoder returns, bad files included.
Run: ``python3 -m pytest -m gpu tests/decoding/audio/test_flac_gpu.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest
from flac_media import pack, reference, write_ffmpeg_cases, write_soundfile_cases

from avpipe.decoding.audio import _flac_cuda as fc

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    d = tmp_path_factory.mktemp("flac_gpu_cases")
    return write_soundfile_cases(str(d)) + write_ffmpeg_cases(str(d))


def test_gpu_decode_is_bit_exact(cases):
    import cupy

    buf, offsets = pack(cases)
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(buf.nbytes), np.uint8, buf.nbytes)
    pinned[:] = buf
    x, plan, left = fc.decode_on_gpu(pinned, offsets)
    assert left == {}, left
    got = cupy.asnumpy(x)
    for i, p in enumerate(cases):
        ref = reference(p)
        np.testing.assert_array_equal(got[i, : len(ref)], ref, err_msg=os.path.basename(p))
        assert not got[i, len(ref) :].any()


def test_gpu_damaged_file_is_handed_back(cases):
    import cupy

    paths = [p for p in cases if "speech_PCM_16_0.6" in p or "noise_PCM_16_0.6" in p][:2]
    buf, offsets = pack(paths)
    si = fc.parse_streaminfo(buf[offsets[0] : offsets[1]])
    buf[int(offsets[0]) + si.audio_offset + 3000] ^= 0x10
    x, plan, left = fc.decode_on_gpu(buf, offsets)  # pageable host memory works too
    assert set(left) == {0}
    got = cupy.asnumpy(x)
    assert not got[0].any()
    ref = reference(paths[1])
    np.testing.assert_array_equal(got[1, : len(ref)], ref)


@pytest.mark.parametrize("window", [8, 256])
def test_loader_gpu_decoder_equals_cpu_decoder(cases, tmp_path, monkeypatch, window):
    import cupy

    monkeypatch.setenv("AVPIPE_FLAC_WINDOW", str(window))  # files decoded per GPU launch

    from avpipe.pipeline.audio_loader import AudioBatchLoader

    same_rate = [p for p in cases if os.path.basename(p).startswith(("sf_speech", "sf_noise",
                                                                       "ff_", "handmade"))]
    bad = tmp_path / "bad.flac"
    data = bytearray(open(same_rate[0], "rb").read())
    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)  # second half zeroed
    bad.write_bytes(bytes(data))
    not_flac = tmp_path / "really_a_wav.flac"
    import soundfile as sf

    sf.write(not_flac, np.zeros(100, np.float32), 16000, format="WAV", subtype="PCM_16")
    missing = tmp_path / "missing.flac"
    paths = same_rate[:9] + [str(bad), str(not_flac), str(missing)] + same_rate[9:]
    kw = dict(batch_size=8, prefetch=1, max_samples=50000)
    with AudioBatchLoader(paths, device="cuda", decoder="gpu", **kw) as g:
        assert g.decoder == "gpu"
        got = list(g.batches(epochs=2))
    with AudioBatchLoader(paths, device="cpu", num_workers=2, transport="float32", **kw) as c:
        assert c.decoder == "cpu"
        want = list(c.batches(epochs=2))
    assert len(got) == len(want)
    for (xg, lg, pg, eg), (xc, lc, pc, ec) in zip(got, want):
        assert pg == pc
        np.testing.assert_array_equal(lg, lc)
        assert [i for i, _ in eg] == [i for i, _ in ec], (eg, ec)
        np.testing.assert_array_equal(cupy.asnumpy(xg), xc)


def test_loader_survives_a_failing_gpu_decoder(cases, monkeypatch):
    import cupy

    from avpipe.pipeline.audio_loader import AudioBatchLoader

    paths = [p for p in cases if os.path.basename(p).startswith("sf_speech")][:5]

    def boom(*a, **k):
        raise RuntimeError("no NVRTC here")

    from avpipe.decoding.audio import flac_gpu

    # the window loader launches through the public module's name (bound at its import)
    monkeypatch.setattr(flac_gpu, "launch", boom)
    with pytest.warns(RuntimeWarning, match="decoding on the CPU instead"):
        with AudioBatchLoader(paths, batch_size=2, device="cuda", decoder="gpu") as g:
            got = list(g.batches())
    assert [len(b[2]) for b in got] == [2, 2, 1]
    for x, lens, group, errors in got:
        assert errors == ()
        for row, n, p in zip(cupy.asnumpy(x), lens, group):
            ref = reference(p)
            assert n == len(ref)
            np.testing.assert_array_equal(row[: len(ref)], ref)


def test_loader_decode_groups_gpu_equals_cpu(cases):
    import cupy

    from avpipe.pipeline.audio_loader import AudioBatchLoader

    paths = [p for p in cases if os.path.basename(p).startswith(("sf_speech", "sf_noise"))][:8]
    rng = np.random.default_rng(0)
    groups = [rng.permutation(len(paths))[: 1 + k % 4].tolist() for k in range(12)]
    kw = dict(batch_size=4, prefetch=1, max_samples=50000)
    with AudioBatchLoader(paths, device="cuda", decoder="gpu", **kw) as g:
        got = list(g.decode_groups(iter(groups)))
    with AudioBatchLoader(paths, device="cpu", num_workers=2, transport="float32", **kw) as c:
        want = list(c.decode_groups(groups))
    assert len(got) == len(want) == len(groups)
    for gr, (xg, lg, pg, eg), (xc, lc, pc, ec) in zip(groups, got, want):
        assert [i for i, _ in eg] == [i for i, _ in ec]
        assert pg == pc == [paths[i] for i in gr]
        np.testing.assert_array_equal(lg, lc)
        np.testing.assert_array_equal(cupy.asnumpy(xg), xc)
