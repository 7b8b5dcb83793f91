"""FLAC decoding on the GPU, bit-exact to libFLAC (private; used by the audio batch loader's
windows of files and by ``load_audio`` on a GPU, one file at a time).

Why: for the ASR log-mel workload the CPU's FLAC decoding is the bound (libsndfile in worker
processes, or DALI's C++ threads, decode several times fewer audio-seconds per second than the
GPU computes log-mel; figures: docs/how-it-works.md, "Measured trade-offs"). FLAC frames are
independent and self-delimiting, so one GPU thread per frame decodes a batch of files at once
(``_flac_kernels.cu`` explains the three kernels). The host reads the files' bytes (no
decoding), parses STREAMINFO, uploads the bytes and launches the kernels; one small read-back
per batch says which files the GPU covered exactly, and the caller decodes any other file on the
CPU (soundfile), so the result is always libFLAC's.

``plan_batch`` / ``finish_batch`` hold the host logic shared by the GPU runner here and by the
CPU test of the kernels (which compiles the same ``.cu`` source as C++).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ...device import pinned_size, upload_many
from ...device.cuda_modules import CudaModule
from ._flac_meta import CRC8, CRC16, StreamInfo, parse_streaminfo

PAD = 64  # bytes after a batch's data: the bit reader may look this far ahead

MAX_BPS = 24  # 32-bit streams go to the CPU (their side channels need 33 bits)
# the most samples a byte of frames can hold: a frame is at least 8 bytes (header, one
# constant subframe, CRC-16) and holds at most 65,535 samples; a STREAMINFO count past
# (bytes // 8 + 1) * 65,536 is a lie that would size the GPU's output (a fuzzed header asked
# for 55 TB), so such a file goes to the CPU, whose decode finds what its frames hold
MIN_FRAME_BYTES = 8
MAX_BLOCK = 65536


def most_samples(audio_bytes):
    """The most samples ``audio_bytes`` bytes of FLAC frames can hold (numpy or int)."""
    return (audio_bytes // MIN_FRAME_BYTES + 1) * MAX_BLOCK


@dataclass
class Plan:
    """Per-batch arrays for the kernels (numpy) and what the host knows before decoding."""

    nbytes: int
    istart: np.ndarray  # int64 [B] first audio byte of each item in the batch buffer
    iend: np.ndarray  # int64 [B] end of each item (== istart for items left to the CPU)
    imeta: np.ndarray  # int32 [B, 6] channels, bits per sample, nominal block size, rate,
    #                    fixed blocksize (0/1), frames (see _flac_kernels.cu, META)
    itotal: np.ndarray  # int64 [B] samples per channel (0 for items left to the CPU)
    ipcm: np.ndarray  # int64 [B] offset of the item's PCM in the int32 scratch
    iclaim: np.ndarray  # int64 [B] offset of a fixed-blocksize item's frame claims
    pcm_size: int
    claims_size: int
    any_fixed: bool  # some item takes the one-pass decode (fixed block size)
    any_other: bool  # some item takes the two-pass decode
    cap: int  # candidate capacity
    infos: list  # StreamInfo or None per item
    cpu: dict  # item -> why the GPU does not try it
    max_len: int


def _be(buf: np.ndarray, pos: np.ndarray, nbytes: int) -> np.ndarray:
    """The big-endian unsigned integers of ``nbytes`` bytes at each of ``pos`` (uint64)."""
    v = np.zeros(len(pos), np.uint64)
    for k in range(nbytes):
        v = (v << np.uint64(8)) | buf[pos + k].astype(np.uint64)
    return v


def scan_streaminfo(buf: np.ndarray, offsets: np.ndarray, *, max_blocks: int = 16):
    """:func:`parse_streaminfo` of every file of a batch buffer at once, for the usual layout
    ("fLaC", STREAMINFO first, at most ``max_blocks`` metadata blocks, no ID3 tag): a dict of
    int64 arrays (``sample_rate``, ``channels``, ``bits_per_sample``, ``total_samples``,
    ``min_block``, ``max_block``, ``audio_offset``) and the boolean mask of the files it read.
    The others (an ID3 tag, metadata cut short, not FLAC, odd blocks) are left to
    :func:`parse_streaminfo`, which reads them or says why not. Parsed one by one, a window's
    files would hold the GIL about 10 us each, time the feed's producer thread waits for."""
    lo = np.asarray(offsets[:-1], np.int64)
    size = np.asarray(offsets[1:], np.int64) - lo
    top = len(buf) - 1
    ok = size >= 4 + 4 + 34

    def at(rel, n=1):  # bytes at lo + rel, clipped into the buffer (masked out by ok anyway)
        return _be(buf, np.minimum(lo + rel, top - n + 1), n)

    ok &= at(0, 4) == np.uint64(int.from_bytes(b"fLaC", "big"))
    head = at(4)
    ok &= (head & np.uint64(0x7F)) == 0
    ok &= at(5, 3) >= 34
    min_block, max_block = at(8, 2), at(10, 2)
    x = at(18, 8)
    pos = np.full(len(lo), 4, np.int64)
    done = np.zeros(len(lo), bool)
    for _ in range(max_blocks):
        live = ok & ~done
        if not live.any():
            break
        if not (pos[live] + 4 <= size[live]).all():
            ok &= ~(live & (pos + 4 > size))
            live &= ok
        h = at(pos)
        length = at(pos + 1, 3).astype(np.int64)
        ok &= ~(live & ((h & np.uint64(0x7F)) == 127))
        pos = np.where(live, pos + 4 + length, pos)
        done |= live & ((h & np.uint64(0x80)) != 0)
    ok &= done & (pos <= size)
    u = np.uint64
    fields = dict(
        sample_rate=(x >> u(44)).astype(np.int64),
        channels=((x >> u(41)) & u(7)).astype(np.int64) + 1,
        bits_per_sample=((x >> u(36)) & u(31)).astype(np.int64) + 1,
        total_samples=(x & u((1 << 36) - 1)).astype(np.int64),
        min_block=min_block.astype(np.int64),
        max_block=max_block.astype(np.int64),
        audio_offset=pos,
    )
    return fields, ok


def gpu_refusals(parsed, total, bps, audio_bytes):
    """The plan's rule for which files the GPU decodes, from each file's STREAMINFO (``total``
    samples per channel, ``bps`` bits per sample) and its ``audio_bytes`` bytes of frames
    (int64 arrays, one entry per file; ``parsed``: whose STREAMINFO was read). Returns the mask
    of the files the GPU decodes and ``{index: why not}`` for the parsed files it leaves to the
    CPU: no sample count (a stream written before its length was known), samples of more than
    :data:`MAX_BPS` or fewer than 4 bits, a count its bytes cannot hold (:func:`most_samples`).
    The channel count needs no rule: FLAC's 1 to 8 channels are all decoded."""
    parsed = np.asarray(parsed, bool)
    total, bps = np.asarray(total, np.int64), np.asarray(bps, np.int64)
    audio_bytes = np.asarray(audio_bytes, np.int64)
    why = {}
    no_count = parsed & (total <= 0)
    odd_bps = parsed & ~no_count & ((bps > MAX_BPS) | (bps < 4))
    for i in np.flatnonzero(no_count).tolist():
        why[i] = "STREAMINFO does not give the sample count"
    for i in np.flatnonzero(odd_bps).tolist():
        why[i] = f"{int(bps[i])}-bit samples"
    lies = parsed & ~no_count & ~odd_bps & (total > most_samples(audio_bytes))
    for i in np.flatnonzero(lies).tolist():
        why[i] = (f"STREAMINFO declares {int(total[i])} samples, more than its "
                  f"{int(audio_bytes[i])} bytes of frames can hold")
    return parsed & ~no_count & ~odd_bps & ~lies, why


def file_refusal(info: StreamInfo, file_bytes: int) -> str | None:
    """:func:`gpu_refusals` for one file of ``file_bytes`` bytes whose STREAMINFO is ``info``:
    why the GPU does not decode it, or None."""
    audio = max(int(file_bytes) - int(info.audio_offset), 0)
    _, why = gpu_refusals([True], [info.total_samples], [info.bits_per_sample], [audio])
    return why.get(0)


def plan_batch(buf: np.ndarray, offsets: np.ndarray, leave: dict | None = None) -> Plan:
    """``buf``: uint8 holding the files back to back (``PAD`` spare bytes after the last);
    ``offsets``: int64 ``[B + 1]``, item ``i`` is ``buf[offsets[i]:offsets[i+1]]``. ``leave``:
    items (index -> why) the caller already leaves to the CPU (a STREAMINFO count that its
    frames contradict: the GPU would decode just the samples it declares)."""
    offsets = np.asarray(offsets, np.int64)
    b = len(offsets) - 1
    lo, hi = offsets[:-1], offsets[1:]
    f, ok = scan_streaminfo(buf, offsets)
    f = {k: v.copy() for k, v in f.items()}
    parsed = ok.copy()
    cpu: dict = {}
    infos: list = [None] * b
    for i in np.flatnonzero(~ok).tolist():  # the odd ones, one by one
        try:
            si = parse_streaminfo(buf[int(lo[i]) : int(hi[i])])
        except ValueError as e:
            cpu[i] = str(e)
            continue
        parsed[i] = True
        for k in f:
            f[k][i] = getattr(si, k)
        infos[i] = si
    cols = [f[k][ok].tolist() for k in ("sample_rate", "channels", "bits_per_sample",
                                        "total_samples", "min_block", "max_block",
                                        "audio_offset")]
    for i, row in zip(np.flatnonzero(ok).tolist(), zip(*cols)):
        infos[i] = StreamInfo(*row)
    total, bps, ch = f["total_samples"], f["bits_per_sample"], f["channels"]
    mnb, mxb = f["min_block"], f["max_block"]
    audio_bytes = np.maximum(hi - (lo + f["audio_offset"]), 0)
    gpu, why = gpu_refusals(parsed, total, bps, audio_bytes)
    cpu.update(why)
    for i, why in (leave or {}).items():
        if 0 <= i < b:
            cpu[i] = why
            gpu[i] = False
    istart = np.where(parsed, lo + f["audio_offset"], lo)
    iend = np.where(gpu, hi, istart)
    imeta = np.zeros((b, 6), np.int32)
    imeta[:, 0], imeta[:, 1] = ch, bps
    imeta[:, 2], imeta[:, 3] = np.maximum(mxb, 1), f["sample_rate"]
    imeta[~parsed, :4] = 0
    itotal = np.where(gpu, total, 0)
    pcm_each = np.where(gpu, ch * total, 0)
    ipcm = np.where(gpu, np.cumsum(pcm_each) - pcm_each, 0)
    fixed = gpu & (mnb == mxb) & (mxb >= 16)
    frames = np.where(fixed, -(-total // np.maximum(mxb, 1)), 0)
    imeta[:, 4], imeta[:, 5] = fixed, frames
    iclaim = np.where(fixed, np.cumsum(frames) - frames, -1)
    block = np.maximum(16, np.minimum(np.where(mnb > 0, mnb, 16), np.where(mxb > 0, mxb, 16)))
    cap = 64 + int(np.where(gpu, total // block + 2, 0).sum()) + int(offsets[-1]) // 4096
    lengths = np.where(gpu, total, 0)  # the CPU's rows widen the output when they need to
    return Plan(
        nbytes=int(offsets[-1]) + PAD,
        istart=istart.astype(np.int64),
        iend=iend.astype(np.int64),
        imeta=imeta,
        itotal=itotal.astype(np.int64),
        ipcm=ipcm.astype(np.int64),
        iclaim=iclaim.astype(np.int64),
        pcm_size=max(int(pcm_each.sum()), 1),
        claims_size=max(int(frames.sum()), 1),
        any_fixed=bool(fixed.any()),
        any_other=bool((gpu & ~fixed).any()),
        cap=int(cap),
        infos=infos,
        cpu=dict(sorted(cpu.items())),
        max_len=int(lengths.max(initial=0)),
    )


def plan_modes(plan: Plan) -> list:
    """The passes of ``flac_frames`` this batch needs: 2 for the fixed-blocksize files (one
    pass), 0 then 1 for the others (check, then decode)."""
    return ([2] if plan.any_fixed else []) + ([0, 1] if plan.any_other else [])


def finish_batch(plan: Plan, cover: np.ndarray) -> dict:
    """Items the GPU did not decode exactly (item -> why): the caller decodes them on the CPU."""
    out = dict(plan.cpu)
    for i in range(len(plan.infos)):
        if i in out:
            continue
        if int(cover[i]) != int(plan.itotal[i]):
            out[i] = (
                f"GPU frames cover {int(cover[i])} of {int(plan.itotal[i])} samples "
                "(a frame it could not decode)"
            )
    return out


# ---------------------------------------------------------------------------------------------
# GPU runner
# ---------------------------------------------------------------------------------------------

_KERNELS = CudaModule(__file__, "_flac_kernels.cu", options=("-std=c++14",),
                      names=("flac_scan", "flac_frames", "flac_to_float"))
KERNEL_FILE = _KERNELS.paths[0]  # the source (the CPU tests build it as C++)
_CRC: dict = {}  # device id -> (CRC8, CRC16) tables on it
_LOCK = threading.Lock()


def _kernels(cupy):
    dev = cupy.cuda.Device().id
    k = _KERNELS.get(dev)
    crc = _CRC.get(dev)
    if crc is None:
        with _LOCK:
            crc = _CRC.get(dev)
            if crc is None:
                crc = _CRC[dev] = (cupy.asarray(CRC8), cupy.asarray(CRC16))
    return k["flac_scan"], k["flac_frames"], k["flac_to_float"], crc[0], crc[1]


def compile_kernels() -> None:
    """Compile (or load from CuPy's cache) the decoder's kernels for the current device now,
    e.g. in a thread while files are being opened; the first :func:`launch` waits for it."""
    import cupy

    _kernels(cupy)


@dataclass
class Launched:
    """A batch whose decode is queued on the GPU (see :func:`launch`)."""

    x: object  # cupy float32 [B, max(max_len, 1)]
    plan: Plan
    cover: np.ndarray  # page-locked, filled by the queued copy
    done: object  # cupy Event after that copy
    inputs: tuple  # device arrays the queued kernels still read
    pcm: object = None  # cupy int32: each item's samples, channel after channel (item_channels)


def launch(buf: np.ndarray, offsets: np.ndarray, plan: Plan | None = None) -> Launched:
    """Queue the upload and the decode of the FLAC files in ``buf`` (see :func:`plan_batch`)
    on the current cupy device and stream, without waiting; :func:`collect` waits for this
    batch only. ``buf`` must stay unchanged until then (page-locked for an asynchronous upload)."""
    import cupy

    if plan is None:
        plan = plan_batch(buf, offsets)
    scan, frames, to_float, crc8, crc16 = _kernels(cupy)
    stream = cupy.cuda.get_current_stream()
    nb = plan.nbytes
    data = cupy.empty(nb, cupy.uint8)
    cupy.cuda.runtime.memcpyAsync(
        data.data.ptr, buf.ctypes.data, nb, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr
    )
    b = len(plan.infos)
    # the per-file tables in one copy from pinned memory, queued without waiting for the
    # stream (a pageable copy would wait for the previous window's decode)
    meta, imeta = upload_many(cupy, [
        np.concatenate([plan.istart, plan.iend, plan.itotal, plan.ipcm, plan.iclaim]),
        plan.imeta])  # fmt: skip
    istart, iend, itotal, ipcm, iclaim = meta.reshape(5, b)
    flags = cupy.zeros(nb, cupy.uint8)
    cand = cupy.empty(plan.cap, cupy.int64)
    n_cand = cupy.zeros(1, cupy.int32)
    valid = cupy.zeros(plan.cap, cupy.uint8)
    cover = cupy.zeros(b, cupy.uint64)
    claims = cupy.zeros(plan.claims_size, cupy.uint32)
    pcm = cupy.empty(plan.pcm_size, cupy.int32)
    i64, i32 = np.int64, np.int32
    threads = 256
    scan(
        ((nb + threads - 1) // threads,),
        (threads,),
        (data, i64(nb), istart, iend, imeta, itotal, i32(b), crc8, flags, cand, n_cand,
         i32(plan.cap), iclaim, claims),
    )
    # few, long-running threads: small blocks spread them over every SM
    fthreads = 32
    fgrid = ((plan.cap + fthreads - 1) // fthreads,)
    for mode in plan_modes(plan):
        frames(
            fgrid,
            (fthreads,),
            (data, i64(nb), istart, iend, imeta, itotal, i32(b), crc8, crc16, flags, cand,
             n_cand, i32(plan.cap), i32(mode), valid, cover, pcm, ipcm, iclaim, claims),
        )
    max_len = max(plan.max_len, 1)
    out = cupy.empty((b, max_len), cupy.float32)
    n = b * max_len
    to_float(
        ((n + threads - 1) // threads,),
        (threads,),
        (pcm, ipcm, itotal, imeta, i32(b), i64(max_len), out),
    )
    mem = cupy.cuda.alloc_pinned_memory(pinned_size(max(b, 1) * 8))  # a size the pool reuses
    host = np.frombuffer(mem, np.uint64, b)
    cupy.cuda.runtime.memcpyAsync(
        host.ctypes.data, cover.data.ptr, b * 8, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr
    )
    done = cupy.cuda.Event(block=False, disable_timing=True)
    done.record(stream)
    return Launched(out, plan, host, done, (data, meta, imeta, flags, cand, n_cand, valid, cover,
                                           claims, pcm), pcm)


def collect(job: Launched):
    """Wait for ``job`` (only it: work queued after it keeps running) and return
    ``(signals, plan, left)``: ``signals`` cupy float32 ``[B, max_len]``, mono (channels
    averaged), zero past each length and in the rows of ``left``, the items (index -> why)
    the caller must decode on the CPU."""
    job.done.synchronize()
    left = finish_batch(job.plan, job.cover)
    out = job.x
    for i in left:
        out[i] = 0
    job.inputs, job.pcm = (), None
    if job.plan.max_len < out.shape[1]:
        out = out[:, : job.plan.max_len]
    return out, job.plan, left


def item_channels(xp, pcm, plan: Plan, item: int):
    """One decoded item's samples, float32 ``[n, channels]`` of array module ``xp`` (a view of
    ``pcm``, the kernels' int32 samples, scaled): each channel apart, scaled as
    ``flac_to_float`` scales (x / 2^(bps-1), exact in float32 for up to 24 bits, as libsndfile
    scales), where the rows of :func:`collect` average them."""
    ch, bps = int(plan.imeta[item, 0]), int(plan.imeta[item, 1])
    n, at = int(plan.itotal[item]), int(plan.ipcm[item])
    x = pcm[at : at + ch * n].reshape(ch, n).T
    return x.astype(xp.float32) * xp.float32(1.0 / (1 << (bps - 1)))


def collect_channels(job: Launched, item: int = 0):
    """Wait for ``job`` and return ``(samples, why)`` for one of its items: ``samples``, cupy
    float32 ``[n, channels]`` (:func:`item_channels`), or None and why the GPU did not decode
    it exactly (a frame it could not decode: the caller decodes it on the CPU)."""
    import cupy

    job.done.synchronize()
    left = finish_batch(job.plan, job.cover)
    pcm, job.inputs, job.pcm = job.pcm, (), None
    if item in left:
        return None, left[item]
    return item_channels(cupy, pcm, job.plan, item), None


def decode_on_gpu(buf: np.ndarray, offsets: np.ndarray, plan: Plan | None = None):
    """:func:`launch` then :func:`collect`: decode the FLAC files in ``buf`` now."""
    return collect(launch(buf, offsets, plan))
