"""A file NVDEC fails on must not poison the process: the failed session is never reused, and
the good files that follow decode (GPU machine only; each sequence runs in its own process,
since the failure this guards against was a SIGABRT)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from paths import REPO as ROOT
from paths import SUPPORT, TESTS
from video_media import make_video

SAMPLES = os.path.join(ROOT, "samples", "video")

pytestmark = pytest.mark.gpu


def _run(paths, env=None, timeout=240):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([ROOT, e.get("PYTHONPATH", "")])
    e.update(env or {})
    r = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, "nvdec_sequence.py"), *map(str, paths)],
        capture_output=True, text=True, timeout=timeout, env=e,
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    assert lines and lines[-1] == "DONE", r.stdout[-3000:]
    return [ln for ln in lines if ln.startswith(("ok ", "typed "))]


def _bitflips(src, out_dir, n, seed):
    data = bytearray(open(src, "rb").read())
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        b = bytearray(data)
        lo = 0 if k % 3 == 0 else len(b) // 3  # headers (moov sits at either end) or payload
        for _ in range(int(rng.integers(1, 8))):
            at = int(rng.integers(lo, len(b)))
            b[at] ^= 1 << int(rng.integers(0, 8))
        p = os.path.join(out_dir, f"flip_{k:03d}.mp4")
        open(p, "wb").write(bytes(b))
        out.append(p)
    return out


@pytest.mark.parametrize("packets", ["auto", "0"])
def test_failed_hevc_session_then_good_files(tmp_path, packets):
    """A tiny HEVC file (NVDEC's decoder creation fails on it: under HEVC's minimum size) then
    good videos, small ones included (they take the SimpleDecoder path, whose session the
    failed file once left broken in the thread's cache: the next file aborted the process)."""
    tiny = make_video(tmp_path / "tiny265.mp4", codec="hevc", num_frames=10, width=64, height=48)
    small_h264 = make_video(tmp_path / "g264s.mp4", codec="h264", num_frames=30)  # 128x96
    good_h264 = make_video(tmp_path / "g264.mp4", codec="h264", num_frames=40, width=320,
                           height=240)
    # (closed GOPs: an open-GOP HEVC file never opens a SimpleDecoder, see the test below)
    good_hevc = make_video(tmp_path / "g265.mkv", codec="hevc", num_frames=40, width=320,
                           height=240)
    vp9 = os.path.join(SAMPLES, "circles_vp9.webm")
    seq = [tiny, small_h264, tiny, vp9, tiny, good_hevc, tiny, good_h264, tiny, tiny, small_h264]
    lines = _run(seq, env={"AVPIPE_NVDEC_PACKETS": packets})
    oks = [ln for ln in lines if ln.startswith("ok ")]
    assert len(oks) == len(seq), lines  # every file decodes (the tiny one on the CPU)
    for ln in oks:
        if "tiny265" not in ln:
            assert "backend=nvdec" in ln, ln


def test_open_gop_hevc_between_good_files_with_the_packet_path_off(tmp_path):
    """circles_hevc.mp4 (open GOPs) with the packet path off: decoded on the CPU, named so in
    its backend, between good files NVDEC decodes (the SimpleDecoder path)."""
    good_h264 = make_video(tmp_path / "g264.mp4", codec="h264", num_frames=40, width=320,
                           height=240)
    circles = os.path.join(SAMPLES, "circles_hevc.mp4")
    lines = _run([good_h264, circles, good_h264, circles], env={"AVPIPE_NVDEC_PACKETS": "0"})
    oks = [ln for ln in lines if ln.startswith("ok ")]
    assert len(oks) == 4, lines
    for ln in oks:
        assert ("backend=nvdec" in ln) == ("g264" in ln), ln


@pytest.mark.parametrize("packets", ["auto", "0"])
def test_bitflipped_hevc_then_good_files(tmp_path, packets):
    good_h264 = make_video(tmp_path / "g264.mp4", codec="h264", num_frames=40, width=320,
                           height=240)
    good_hevc = make_video(tmp_path / "g265.mp4", codec="hevc", num_frames=40, width=320,
                           height=240)
    flips = _bitflips(good_hevc, tmp_path, 24, seed=11)
    shutil.copy(good_hevc, tmp_path / "g265_copy.mp4")
    seq = []
    for f in flips:
        seq += [f, good_h264, str(tmp_path / "g265_copy.mp4")]
    lines = _run(seq, env={"AVPIPE_NVDEC_PACKETS": packets}, timeout=400)
    goods = [ln for ln in lines if " " + str(tmp_path / "g26") in ln]
    assert len(goods) == 2 * len(flips), lines
    assert all(ln.startswith("ok ") and "backend=nvdec" in ln for ln in goods), goods


def test_mislabelled_frames_session_is_not_reused(tmp_path):
    """The fuzz corpus's case h264_mp4-0022 (seed 11): its H.264 seed with 359 bytes zeroed at
    byte 2195. PyNvVideoCodec's SimpleDecoder prints "Decode Error occurred for picture N" on it
    and labels a frame wrongly (that frame is decoded on the CPU). That session, cached and
    reconfigured for the feed's next file, crashed the process (SIGSEGV). Run as the fuzz
    harness runs it: one video feed epoch over [damaged, clean], in its own process."""
    sys.path.insert(0, TESTS)
    from fuzz import corpus

    seeds = corpus.make_seeds(tmp_path / "seeds")
    data = bytearray(open(seeds["h264_mp4"], "rb").read())
    data[2195 : 2195 + 359] = bytes(359)
    bad = tmp_path / "zero_fill.mp4"
    bad.write_bytes(bytes(data))
    case = dict(id="zero_fill", family="h264_mp4", kind="video", path=str(bad),
                damage="zero_fill", detail="at=2195 len=359", expect="any")  # fmt: skip
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from fuzz import harness; "
        "print(harness.run_feed_unit('video_feed_cuda', [eval(sys.argv[2])], "
        "{'h264_mp4': sys.argv[3]}), flush=True); print('DONE', flush=True)"
    )
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([ROOT, e.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code, TESTS, repr(case), seeds["h264_mp4"]],
                       capture_output=True, text=True, timeout=240, env=e)  # fmt: skip
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.splitlines()[-1] == "DONE", r.stdout[-3000:]
    assert "'outcome': 'decoded" in r.stdout or "'outcome': 'skipped'" in r.stdout, r.stdout
