"""The GPU FLAC kernels, compiled as plain C++ and run here on the CPU, decode bit-exactly what
libFLAC decodes (the GPU test runs the same source through NVRTC: test_flac_gpu.py)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from cpp_kernels import build
from flac_media import pack, reference, write_ffmpeg_cases, write_soundfile_cases

from avpipe.decoding.audio import _flac_cuda as fc

PRELUDE = r"""
#include <cstdint>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads()
struct Dim3 { unsigned x; };
static Dim3 threadIdx, blockIdx, blockDim;
static inline int __clzll(unsigned long long x) { return x ? __builtin_clzll(x) : 64; }
static inline int atomicAdd(int* a, int v) { int o = *a; *a += v; return o; }
static inline unsigned atomicAdd(unsigned* a, unsigned v) { unsigned o = *a; *a += v; return o; }
static inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    unsigned long long o = *a; *a += v; return o; }
"""

LAUNCHERS = r"""
#define LOOP(n, call) do { blockDim.x = 1; threadIdx.x = 0; \
    for (long long t_ = 0; t_ < (n); ++t_) { blockIdx.x = (unsigned)t_; call; } } while (0)
extern "C" void run_scan(long long n, const u8* data, i64 nbytes, const i64* istart,
        const i64* iend, const i32* imeta, const i64* itotal, int n_items, const u8* crc8,
        u8* flags, i64* cand, int* n_cand, int cap, const i64* iclaim, u32* claims) {
    LOOP(n, flac_scan(data, nbytes, istart, iend, imeta, itotal, n_items, crc8, flags, cand,
                      n_cand, cap, iclaim, claims));
}
extern "C" void run_frames(long long n, const u8* data, i64 nbytes, const i64* istart,
        const i64* iend, const i32* imeta, const i64* itotal, int n_items, const u8* crc8,
        const u16* crc16, const u8* flags, const i64* cand, const int* n_cand, int cap, int mode,
        u8* valid, u64* cover, i32* pcm, const i64* ipcm, const i64* iclaim, const u32* claims) {
    LOOP(n, flac_frames(data, nbytes, istart, iend, imeta, itotal, n_items, crc8, crc16, flags,
                        cand, n_cand, cap, mode, valid, cover, pcm, ipcm, iclaim, claims));
}
extern "C" void run_to_float(long long n, const i32* pcm, const i64* ipcm, const i64* itotal,
        const i32* imeta, int n_items, i64 max_len, float* out) {
    LOOP(n, flac_to_float(pcm, ipcm, itotal, imeta, n_items, max_len, out));
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    with open(fc.KERNEL_FILE) as f:
        return build(PRELUDE + f.read() + LAUNCHERS, tmp_path_factory.mktemp("flac_kernels"),
                     flags=("-std=c++14", "-Wno-unused-function", "-Wno-unknown-pragmas"))


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


def decode_cpu(lib, buf, offsets):
    """The GPU runner's sequence (decode_on_gpu), with the kernels run on the CPU."""
    plan = fc.plan_batch(buf, offsets)
    out, _, cover, n_cand = run_kernels(lib, buf, plan)
    left = fc.finish_batch(plan, cover)
    for i in left:
        out[i] = 0
    return out, plan, left, n_cand


def run_kernels(lib, buf, plan):
    """``launch``'s kernels on the CPU: ``(rows, pcm, cover, candidates)``."""
    b = len(plan.infos)
    nb = plan.nbytes
    I64, I32 = ctypes.c_longlong, ctypes.c_int
    flags = np.zeros(nb, np.uint8)
    cand = np.zeros(plan.cap, np.int64)
    n_cand = np.zeros(1, np.int32)
    valid = np.zeros(plan.cap, np.uint8)
    cover = np.zeros(b, np.uint64)
    pcm = np.full(plan.pcm_size, -7, np.int32)
    claims = np.zeros(plan.claims_size, np.uint32)
    items = (_p(plan.istart), _p(plan.iend), _p(plan.imeta), _p(plan.itotal), I32(b))
    lib.run_scan(I64(nb), _p(buf), I64(nb), *items, _p(fc.CRC8), _p(flags), _p(cand),
                 _p(n_cand), I32(plan.cap), _p(plan.iclaim), _p(claims))
    for mode in fc.plan_modes(plan):
        lib.run_frames(I64(plan.cap), _p(buf), I64(nb), *items, _p(fc.CRC8), _p(fc.CRC16),
                       _p(flags), _p(cand), _p(n_cand), I32(plan.cap), I32(mode), _p(valid),
                       _p(cover), _p(pcm), _p(plan.ipcm), _p(plan.iclaim), _p(claims))
    max_len = max(plan.max_len, 1)
    out = np.full((b, max_len), np.nan, np.float32)
    lib.run_to_float(I64(b * max_len), _p(pcm), _p(plan.ipcm), _p(plan.itotal), _p(plan.imeta),
                     I32(b), I64(max_len), _p(out))
    return out, pcm, cover, int(n_cand[0])


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    d = tmp_path_factory.mktemp("flac_cases")
    return write_soundfile_cases(str(d)) + write_ffmpeg_cases(str(d))


def test_kernels_decode_every_case_bit_exactly(lib, cases):
    buf, offsets = pack(cases)
    out, plan, left, n_cand = decode_cpu(lib, buf, offsets)
    assert left == {}, left
    assert n_cand <= plan.cap
    for i, p in enumerate(cases):
        ref = reference(p)
        n = len(ref)
        assert plan.infos[i].total_samples == n, p
        np.testing.assert_array_equal(out[i, :n], ref, err_msg=os.path.basename(p))
        assert not out[i, n:].any(), p  # zero past the length


def test_streaminfo_matches_soundfile(cases):
    import soundfile as sf

    for p in cases:
        si = fc.parse_streaminfo(open(p, "rb").read())
        info = sf.info(p)
        assert (si.sample_rate, si.channels, si.total_samples) == (
            info.samplerate, info.channels, info.frames)


def test_damaged_frames_are_left_to_the_cpu_never_returned(lib, cases):
    """A flipped bit inside a frame fails its CRC-16: the file is handed back (to be decoded
    on the CPU, where libFLAC reports it), never returned with wrong samples; its neighbours in
    the batch are unaffected."""
    paths = [p for p in cases if "speech_PCM_16_0.6" in p or "noise_PCM_16_0.6" in p][:2]
    buf, offsets = pack(paths)
    si = fc.parse_streaminfo(buf[offsets[0] : offsets[1]])
    mid = int(offsets[0]) + si.audio_offset + 3000  # inside the first file's audio frames
    buf[mid] ^= 0x10
    out, plan, left, _ = decode_cpu(lib, buf, offsets)
    assert set(left) == {0} and "cover" in left[0]
    assert not out[0].any()  # the row the caller will fill
    ref = reference(paths[1])
    np.testing.assert_array_equal(out[1, : len(ref)], ref)


def test_not_flac_and_truncated_metadata_are_reported(lib, cases):
    good = open(cases[0], "rb").read()
    blobs = [b"RIFF0000WAVEfmt garbage", good[:20], good]
    offsets = np.zeros(4, np.int64)
    offsets[1:] = np.cumsum([len(b) for b in blobs])
    buf = np.zeros(int(offsets[-1]) + fc.PAD, np.uint8)
    for b, o in zip(blobs, offsets):
        buf[o : o + len(b)] = np.frombuffer(b, np.uint8)
    out, plan, left, _ = decode_cpu(lib, buf, offsets)
    assert "not a FLAC" in left[0] and "cut short" in left[1] and 2 not in left
    ref = reference(cases[0])
    np.testing.assert_array_equal(out[2, : len(ref)], ref)


def test_truncated_audio_is_left_to_the_cpu(lib, cases):
    p = [c for c in cases if "speech_PCM_16_1.0" in c][0]
    data = open(p, "rb").read()
    cut = data[: len(data) * 2 // 3]
    offsets = np.array([0, len(cut)], np.int64)
    buf = np.zeros(len(cut) + fc.PAD, np.uint8)
    buf[: len(cut)] = np.frombuffer(cut, np.uint8)
    _, plan, left, _ = decode_cpu(lib, buf, offsets)
    assert 0 in left and "cover" in left[0]


def _plan_one_by_one(buf, offsets):
    """The plan as it was made before the vectorized scan: each file parsed alone (the
    reference the batch plan must equal)."""
    b = len(offsets) - 1
    istart, iend, itotal, ipcm = (np.zeros(b, np.int64) for _ in range(4))
    imeta, iclaim = np.zeros((b, 6), np.int32), np.full(b, -1, np.int64)
    infos, cpu, pcm, claims, cap = [], {}, 0, 0, 64
    for i in range(b):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        try:
            si = fc.parse_streaminfo(buf[lo:hi])
        except ValueError as e:
            infos.append(None)
            cpu[i] = str(e)
            istart[i] = iend[i] = lo
            continue
        infos.append(si)
        istart[i] = iend[i] = lo + si.audio_offset
        imeta[i, :4] = (si.channels, si.bits_per_sample, max(si.max_block, 1), si.sample_rate)
        if si.total_samples <= 0:
            cpu[i] = "STREAMINFO does not give the sample count"
        elif si.bits_per_sample > fc.MAX_BPS or si.bits_per_sample < 4:
            cpu[i] = f"{si.bits_per_sample}-bit samples"
        elif si.total_samples > fc.most_samples(max(hi - lo - si.audio_offset, 0)):
            cpu[i] = (f"STREAMINFO declares {si.total_samples} samples, more than its "
                      f"{max(hi - lo - si.audio_offset, 0)} bytes of frames can hold")
        else:
            iend[i], itotal[i], ipcm[i] = hi, si.total_samples, pcm
            pcm += si.channels * si.total_samples
            if si.min_block == si.max_block >= 16:
                frames = -(-si.total_samples // si.max_block)
                imeta[i, 4:] = (1, frames)
                iclaim[i] = claims
                claims += frames
            cap += si.total_samples // max(16, min(si.min_block or 16, si.max_block or 16)) + 2
    cap += int(offsets[-1]) // 4096
    return dict(istart=istart, iend=iend, itotal=itotal, ipcm=ipcm, imeta=imeta, iclaim=iclaim,
                infos=infos, cpu=cpu, pcm_size=max(pcm, 1), claims_size=max(claims, 1),
                cap=cap, max_len=int(itotal.max(initial=0)))


def test_batch_plan_equals_the_plan_of_each_file_parsed_alone(cases, tmp_path):
    """The vectorized STREAMINFO scan gives the plan each file parsed alone gives, also for
    the files it leaves to the per-file parser: an ID3 tag in front, many metadata blocks, a
    header cut short, not FLAC, empty, no sample count, 32-bit samples."""
    import struct

    good = [open(p, "rb").read() for p in cases]
    one = good[0]
    si_at = 8  # STREAMINFO's body in a plain file ("fLaC" + block header)
    pad_blocks = one[:4] + bytes([one[4] & 0x7F]) + one[5:8 + 34]  # STREAMINFO, not last
    rest = one[8 + 34:]
    many = pad_blocks + b"".join(bytes([1, 0, 0, 3]) + b"\0\0\0" for _ in range(20))
    many += bytes([0x81, 0, 0, 2]) + b"\0\0" + rest  # 22 blocks: past the scan's 16
    blocks3 = pad_blocks + bytes([0x81, 0, 0, 5]) + b"\0" * 5 + rest
    id3 = b"ID3\x04\x00\x00\x00\x00\x00\x0a" + b"\0" * 10 + one
    x = struct.unpack(">Q", one[si_at + 10 : si_at + 18])[0]
    no_count = one[: si_at + 10] + struct.pack(">Q", x & ~((1 << 36) - 1)) + one[si_at + 18:]
    bits32 = one[: si_at + 10] + struct.pack(">Q", x | (31 << 36)) + one[si_at + 18:]
    odd = [many, blocks3, id3, no_count, bits32, one[:30], b"RIFF" + one[4:], b"", one[:9],
           one[:4] + bytes([0x7F]) + one[5:]]
    blobs = good + odd + good[:3]
    paths = []
    for k, blob in enumerate(blobs):
        p = tmp_path / f"f{k}.flac"
        p.write_bytes(blob)
        paths.append(str(p))
    buf, offsets = pack(paths)
    plan = fc.plan_batch(buf, offsets)
    want = _plan_one_by_one(buf, offsets)
    for k in ("istart", "iend", "itotal", "ipcm", "imeta", "iclaim"):
        np.testing.assert_array_equal(getattr(plan, k), want[k], err_msg=k)
    for k in ("infos", "cpu", "pcm_size", "claims_size", "cap", "max_len"):
        assert getattr(plan, k) == want[k], k
    assert plan.nbytes == int(offsets[-1]) + fc.PAD
    n = len(good)
    assert all(i not in plan.cpu for i in range(n))  # every good file goes to the GPU
    assert set(plan.cpu) >= {n + 3, n + 4, n + 5, n + 6, n + 7, n + 8, n + 9}
    assert plan.infos[n] is not None and plan.infos[n + 1] is not None  # read one by one
    assert plan.infos[n + 2] is not None  # the ID3 tag skipped


def test_plan_leaves_files_whose_streaminfo_count_is_not_the_frames_to_the_cpu(tmp_path):
    """The loader's header pass finds FLAC files whose STREAMINFO count their frames contradict
    (or that give none); the plan leaves those to the CPU (load_audio: the damage reported, or
    the frames decoded to their end), never to the GPU, which would decode the declared count
    and call it covered."""
    import soundfile as sf

    from avpipe.decoding.audio._flac_scan import flac_length_of_path
    from avpipe.pipeline.audio_loader import _header_and_size

    x = (np.sin(np.arange(9000) / 5) * 0.3).astype(np.float32)
    p = tmp_path / "a.flac"
    sf.write(p, x, 16000, subtype="PCM_16")
    data = bytearray(p.read_bytes())
    v = int.from_bytes(data[18:26], "big")
    data[18:26] = ((v & ~((1 << 36) - 1)) | 100).to_bytes(8, "big")
    q = tmp_path / "lies.flac"
    q.write_bytes(bytes(data))
    fl = flac_length_of_path(str(q))
    assert fl.info.total_samples == 100 and fl.frames == 9000 and "declares 100" in fl.problem
    leave = {i: g[4] for i, g in enumerate(map(_header_and_size, [str(p), str(q)])) if g[4]}
    assert list(leave) == [1]
    buf, offsets = pack([str(p), str(q)])
    plan = fc.plan_batch(buf, offsets, leave)
    assert list(plan.cpu) == [1] and "declares 100" in plan.cpu[1]
    assert plan.itotal.tolist() == [9000, 0] and plan.iend[1] == plan.istart[1]
    assert fc.plan_batch(buf, offsets).cpu == {}  # by its STREAMINFO alone it looks fine


def test_plan_leaves_a_count_its_bytes_cannot_hold_to_the_cpu(tmp_path):
    """A STREAMINFO count past what the file's frames could hold (a fuzzed header declared
    2^36 - 1 samples: the GPU output was sized at 55 TB, and the whole window fell back to the
    CPU) goes to the CPU, named, and does not size the batch's output."""
    import soundfile as sf

    x = (np.sin(np.arange(9000) / 5) * 0.3).astype(np.float32)
    p = tmp_path / "a.flac"
    sf.write(p, x, 16000, subtype="PCM_16")
    data = bytearray(p.read_bytes())
    v = int.from_bytes(data[18:26], "big")
    data[18:26] = (v | ((1 << 36) - 1)).to_bytes(8, "big")
    q = tmp_path / "huge.flac"
    q.write_bytes(bytes(data))
    buf, offsets = pack([str(p), str(q)])
    plan = fc.plan_batch(buf, offsets)
    assert list(plan.cpu) == [1] and "declares 68719476735 samples" in plan.cpu[1]
    assert plan.max_len == 9000 and plan.itotal.tolist() == [9000, 0]
    assert plan.pcm_size == 9000


def test_load_audio_on_a_gpu_through_the_kernels_is_libflac(lib, cases, tmp_path, monkeypatch):
    """load_audio on a (stand-in) CUDA device with the kernels run on the CPU in place of the
    GPU runner (launch, then collect_channels' item_channels): every case is decoded by
    flac_cuda, each channel bit-exactly libFLAC's; a damaged frame leaves the file to libFLAC,
    which raises a typed error naming it."""
    import soundfile as sf

    import avpipe
    from avpipe.decoding.audio import load as L
    from avpipe.device import Device

    def run(buf, offsets, plan, device):
        _, pcm, cover, _ = run_kernels(lib, buf, plan)
        left = fc.finish_batch(plan, cover)
        if 0 in left:
            return None, left[0]
        return fc.item_channels(np, pcm, plan, 0), None

    monkeypatch.setattr(L, "_decode_on_gpu", run)
    monkeypatch.setattr(L, "_gpu_problem", lambda device: None)
    monkeypatch.setattr(L, "to_device", lambda x, dev: x)
    gpu = Device("cuda", 0)
    for p in cases:
        want, _ = sf.read(p, dtype="float32", always_2d=True)
        a = avpipe.load_audio(p, device=gpu, mono=False)
        assert a.backend == "flac_cuda" and a.fallbacks == (), p
        np.testing.assert_array_equal(a.samples, want.T, err_msg=os.path.basename(p))
        m = avpipe.load_audio(p, device=gpu)
        np.testing.assert_array_equal(m.samples, avpipe.load_audio(p).samples)
    p = [c for c in cases if "speech_PCM_16_0.6" in c][0]
    data = bytearray(open(p, "rb").read())
    data[fc.parse_streaminfo(bytes(data)).audio_offset + 3000] ^= 0x10  # fails a CRC-16
    bad = tmp_path / "flipped.flac"
    bad.write_bytes(bytes(data))
    with pytest.raises(avpipe.CorruptDataError, match="flipped.flac"):
        avpipe.load_audio(bad, device=gpu)
