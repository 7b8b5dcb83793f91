"""NVDEC backend against the CPU backend (run: python3 -m pytest -m gpu tests/decoding/video/test_video_gpu.py)."""

from __future__ import annotations

import fractions
import threading

import numpy as np
import pytest
from paths import SAMPLES
from video_media import CODECS, encoder_available, make_video

import avpipe
from avpipe.ops.color import nv12_to_rgb_device, nv12_to_rgb_reference, yuv_coefficients

pytestmark = pytest.mark.gpu

ALL = [c for c in CODECS if encoder_available(CODECS[c][0])]
W, H = 256, 192  # above NVDEC's minimum sizes for every codec
# what NVDEC decodes on every GPU this project supports: a refusal of one of these is a failure,
# not a skip (a regression that sent everything to the CPU would otherwise read as "skipped")
NVDEC_CODECS = {"h264", "hevc", "vp8", "vp9", "mjpeg"}


def refused(what, codec, reason):
    """Fails for a codec NVDEC must decode; skips for another (AV1 on an older GPU, say)."""
    if codec in NVDEC_CODECS:
        pytest.fail(f"NVDEC refused {what} ({codec}): {reason}")
    pytest.skip(f"NVDEC refused {what}: {reason}")


@pytest.fixture(autouse=True)
def _fresh_nvdec_state(monkeypatch):
    """Each test starts with the packet path and pointer reads on, whatever an earlier one did."""
    from avpipe.decoding.video import _nvdec as nv

    monkeypatch.setattr(nv, "_packet_path", {"enabled": True, "why_off": None, "failures": 0})
    monkeypatch.setattr(nv, "_raw_planes", {"enabled": True, "why_off": None})


def psnr(a, b):
    d = a.astype(np.float64) - b.astype(np.float64)
    mse = np.mean(d * d)
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_video")
    files = {c: make_video(d / f"g_{c}.{CODECS[c][2]}", codec=c, width=W, height=H, num_frames=40)
             for c in ALL}
    tb = fractions.Fraction(1, 1000)
    steps = [40, 20, 60, 33, 47]
    pts = [100 + sum(steps[k % 5] for k in range(i)) for i in range(30)]
    files["vfr"] = make_video(d / "g_vfr.mp4", codec="h264", num_frames=30, pts=pts, time_base=tb,
                              width=W, height=H)
    return files


@pytest.mark.parametrize("codec", ALL + ["vfr"])
def test_nvdec_matches_cpu(media, codec):
    import cupy

    path = media[codec]
    idx = [39 if codec != "vfr" else 29, 3, 3, 17, 0, 11, 10, 9, 22, 25]
    with avpipe.VideoDecoder(path, device="cpu") as cpu:
        ref = cpu.get_frames(idx)
    with avpipe.VideoDecoder(path, device="cuda") as gpu:
        if gpu.backend != "nvdec":
            refused(codec, "h264" if codec == "vfr" else codec, gpu.fallback_reason)
        diag = {}
        try:
            from avpipe.decoding.video._nvdec import nvdec_diagnostics

            diag = nvdec_diagnostics(gpu._gpu, sorted(set(idx)))
        except Exception as e:  # noqa: BLE001
            diag = {"error": repr(e)}
        print(codec, "diagnostics:", diag)
        b = gpu.get_frames(idx)
        assert isinstance(b.data, cupy.ndarray)
        assert b.data.shape == ref.data.shape
        got = cupy.asnumpy(b.data)
        assert b.indices.tolist() == ref.indices.tolist()
        np.testing.assert_allclose(b.pts_seconds, ref.pts_seconds)
        scores = [psnr(got[k], ref.data[k]) for k in range(len(idx))]
        print(codec, "psnr", [round(s, 1) for s in scores], "pts mismatches", gpu._gpu.pts_mismatches)
        assert min(scores) >= 40.0, scores
        # PyNvVideoCodec mislabels HEVC's last frame and cannot seek to AVI's last frame:
        # the CPU fills in those (and only those)
        if codec not in ("hevc", "mjpeg"):
            assert gpu._gpu.pts_mismatches == 0, diag
        # CHW and NV12 outputs
    with avpipe.VideoDecoder(path, device="cuda", layout="CHW") as gpu:
        c = cupy.asnumpy(gpu.get_frames(idx[:3]).data)
        assert psnr(c.transpose(0, 2, 3, 1), ref.data[:3]) >= 40.0


@pytest.mark.parametrize("packets", ["0", "1"])
@pytest.mark.parametrize("codec", ALL)
def test_frames_by_pointer_equal_dlpack(media, codec, packets, monkeypatch):
    """Reading NVDEC frames by their planes' pointers gives the DLPack path's bytes exactly,
    for RGB (HWC, CHW) and NV12 output; and the pointer path is the one taken."""
    import cupy

    from avpipe.decoding.video import _nvdec as nv

    monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", packets)
    used = []
    real = nv.frame_planes

    def counting(frame, h, w):
        r = real(frame, h, w)
        used.append(r is not None)
        return r

    monkeypatch.setattr(nv, "frame_planes", counting)
    idx = [9, 3, 3, 17, 30]
    outs = {}
    for raw in (True, False):
        monkeypatch.setitem(nv._raw_planes, "enabled", raw)
        for output, layout in (("rgb", "HWC"), ("rgb", "CHW"), ("nv12", "HWC")):
            with avpipe.VideoDecoder(media[codec], device="cuda", output=output, layout=layout) as d:
                if d.backend != "nvdec":
                    refused(codec, codec, d.fallback_reason)
                outs[raw, output, layout] = cupy.asnumpy(d.get_frames(idx).data)
                if packets == "1" and codec in ("h264", "hevc"):  # the packet path served it
                    assert d._gpu.packet_path, nv._packet_path
        if raw:  # the pointer path stayed on and was the one taken
            assert nv._raw_planes["enabled"], nv._raw_planes
            assert used and all(used), "PyNvVideoCodec's frames did not expose their planes"
    for output, layout in (("rgb", "HWC"), ("rgb", "CHW"), ("nv12", "HWC")):
        np.testing.assert_array_equal(outs[True, output, layout], outs[False, output, layout])


def test_kernel_equals_reference(media):
    import cupy

    rng = np.random.default_rng(0)
    for h, w in ((96, 128), (49, 67)):
        nv = rng.integers(0, 256, (h + (h + 1) // 2, w + w % 2), dtype=np.uint8)
        for space, rng_tag, fmt in (("bt709", "tv", "yuv420p"), ("unspecified", "pc", "yuvj420p")):
            co = yuv_coefficients(space, rng_tag, fmt)
            ref = nv12_to_rgb_reference(nv, h, w, co)
            out = cupy.empty((h, w, 3), cupy.uint8)
            nv12_to_rgb_device(cupy.asarray(nv), h, w, co, out)
            assert np.abs(cupy.asnumpy(out).astype(int) - ref).max() <= 1


def test_nvdec_threads_and_reuse(media):
    """Several decoders in threads; each thread's decoder is reused across files."""
    import cupy

    files = [media[c] for c in ALL if c in ("h264", "hevc", "vp9")] * 3
    refs = {}
    for p in set(files):
        with avpipe.VideoDecoder(p, device="cpu") as d:
            refs[p] = d.get_frames([5, 30])
    errors = []

    def work(p):
        try:
            with avpipe.VideoDecoder(p, device="cuda") as d:
                b = cupy.asnumpy(d.get_frames([5, 30]).data)
            for k in range(2):
                assert psnr(b[k], refs[p].data[k]) >= 40
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ths = [threading.Thread(target=lambda ps=files[i::3]: [work(p) for p in ps]) for i in range(3)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert not errors, errors


def test_nvdec_fallback_reported(tmp_path):
    """A 10-bit stream is decoded on the CPU (reported), or refused when fallback is off."""
    import av
    from video_media import synth_frame

    p = tmp_path / "ten.mkv"
    with av.open(str(p), "w", format="matroska") as out:
        st = out.add_stream("libx265", rate=25)
        st.width, st.height, st.pix_fmt = W, H, "yuv420p10le"
        st.options = {"x265-params": "log-level=error"}
        for i in range(5):
            fr = av.VideoFrame.from_ndarray(synth_frame(i, W, H), format="rgb24").reformat(format="yuv420p10le")
            for pkt in st.encode(fr):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    with avpipe.VideoDecoder(p, device="cuda") as d:
        assert d.backend == "pyav" and d.fallback_reason
        b = d.get_frames([2])
        assert b.data.shape == (1, H, W, 3)
    with pytest.raises(avpipe.UnsupportedFormatError):
        avpipe.VideoDecoder(p, device="cuda", allow_cpu_fallback=False)


@pytest.mark.parametrize("chunk", ["1", "16"])
@pytest.mark.parametrize("codec", [c for c in ("h264", "hevc") if c in ALL])
def test_packet_path_serves_sparse_requests(media, codec, chunk, monkeypatch):
    """H.264/HEVC requests go through the packet path (disposable packets skipped), frames equal
    the CPU's, and one thread's session moves between files without leaking stale frames."""
    import cupy

    from avpipe.decoding.video import _nvdec as _video_nvdec

    monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", "1")
    monkeypatch.setenv("AVPIPE_NVDEC_CHUNK", chunk)
    other = media["vfr"]
    requests = [(media[codec], [1, 5, 9, 13, 17]), (other, [2, 6, 10]), (media[codec], [30, 34, 38]),
                (media[codec], [0, 4]), (other, [25, 29])]
    for path, idx in requests:
        with avpipe.VideoDecoder(path, device="cpu") as cpu:
            ref = cpu.get_frames(idx).data
        with avpipe.VideoDecoder(path, device="cuda") as gpu:
            got = cupy.asnumpy(gpu.get_frames(idx).data)
            assert gpu._gpu.packet_path, _video_nvdec._packet_path
            assert gpu._gpu.pts_mismatches == 0
        scores = [psnr(got[k], ref[k]) for k in range(len(idx))]
        assert min(scores) >= 40.0, (path, idx, scores)
    assert _video_nvdec._packet_path["enabled"], _video_nvdec._packet_path


@pytest.mark.parametrize("codec", [c for c in ("h264", "hevc") if c in ALL])
def test_packet_path_reads_mp4_packets_itself(tmp_path, codec, monkeypatch):
    """The NVDEC packet path for H.264/HEVC in MP4: packets read from the file by position (no
    demuxer), disposable ones not wanted skipped; frames match the CPU's for clips, scattered and
    repeated indices, across files, in several threads at once."""
    import cupy

    from avpipe.decoding.video import _nvdec as _video_nvdec

    monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", "1")
    paths = [make_video(tmp_path / f"p{i}.mp4", codec=codec, width=W, height=H, num_frames=70,
                        container="mp4") for i in range(2)]
    requests = [(0, [1, 5, 9, 13, 17, 21]), (1, [40, 44, 48]), (0, [69, 0, 33, 33, 12]),
                (1, [2, 3, 4, 5]), (0, [50])]
    ref = {}
    for i, p in enumerate(paths):
        with avpipe.VideoDecoder(p, device="cpu") as cpu:
            ref[i] = cpu
            ref[i] = {k: cpu.get_frames([k]).data[0] for idx in requests for k in idx[1]}
    errors = []

    def work(order):
        try:
            for i, idx in order:
                with avpipe.VideoDecoder(paths[i], device="cuda") as gpu:
                    assert gpu._gpu.packet_path and gpu._gpu.scan.packet_pos is not None
                    got = cupy.asnumpy(gpu.get_frames(idx).data)
                    assert gpu._gpu.pts_mismatches == 0
                for k, j in enumerate(idx):
                    assert psnr(got[k], ref[i][j]) >= 40.0, (codec, i, j)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(requests[s:] + requests[:s],)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
    assert _video_nvdec._packet_path["enabled"], _video_nvdec._packet_path


@pytest.mark.parametrize("name", ["circles_h264.mp4", "circles_hevc.mp4", "squares_h264.mp4"])
def test_simple_decoder_path_frames_equal_the_cpu(name, monkeypatch):
    """The SimpleDecoder path (packet path off): every frame, asked for in clips that start
    past frame 0, equals the CPU's. circles_hevc.mp4 has open GOPs (a CRA every 15 frames with
    two leading pictures), on which PyNvVideoCodec's SimpleDecoder handed out frame 15 for 13
    and misdecoded leading pictures, labelled as the frames asked for: NVDEC refuses it on this
    path, and its frames come from the CPU (simple_decoder_refusal)."""
    import os

    import cupy

    monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", "0")
    path = os.path.join(SAMPLES, "video", name)
    with avpipe.VideoDecoder(path, device="cpu") as cpu:
        n = cpu.metadata.num_frames
        ref = cpu.get_frames(list(range(n))).data
    for clip in ([10, 11, 12, 13, 14, 15, 16], list(range(1, n)), [28, 29, 43, 44], [0, 13, 14]):
        clip = [i for i in clip if i < n]
        with avpipe.VideoDecoder(path, device="cuda") as gpu:
            if name == "circles_hevc.mp4":
                assert gpu.backend != "nvdec" and "open GOPs" in gpu.fallback_reason, (
                    gpu.backend, gpu.fallback_reason)
            else:
                if gpu.backend != "nvdec":
                    refused(name, name.split("_")[1].split(".")[0], gpu.fallback_reason)
                assert not gpu._gpu.packet_path
            got = cupy.asnumpy(gpu.get_frames(clip).data)
        scores = [psnr(got[k], ref[i]) for k, i in enumerate(clip)]
        assert min(scores) >= 40.0, (name, clip, [round(s, 1) for s in scores])
