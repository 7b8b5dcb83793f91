"""FLAC decoding on the GPU, bit-exact to libFLAC (private; used by the audio batch loader).

Why: for the ASR log-mel workload the CPU's FLAC decoding is the bound (libsndfile in worker
processes, or DALI's C++ threads, decode several times fewer audio-seconds per second than the
GPU computes log-mel; ``benchmarks/README.md`` has the figures). FLAC frames are
independent and self-delimiting, so one GPU thread per frame decodes a batch of files at once
(``_flac_kernels.cu`` explains the three kernels). The host reads the files' bytes (no
decoding), parses STREAMINFO, uploads the bytes and launches the kernels; one small read-back
per batch says which files the GPU covered exactly, and the caller decodes any other file on the
CPU (soundfile), so the result is always libFLAC's.

``plan_batch`` / ``finish_batch`` hold the host logic shared by the GPU runner here and by the
CPU test of the kernels (which compiles the same ``.cu`` source as C++).
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

import numpy as np

from ...device import upload_many

KERNEL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_flac_kernels.cu")
PAD = 64  # bytes after a batch's data: the bit reader may look this far ahead

MAX_BPS = 24  # 32-bit streams go to the CPU (their side channels need 33 bits)


def _crc_tables():
    """CRC-8 (0x07) table; CRC-16 (0x8005) tables for four bytes at a time: ``crc16[k*256 + x]``
    is the CRC of byte ``x`` followed by ``k`` zero bytes."""
    crc8 = np.zeros(256, np.uint8)
    crc16 = np.zeros((4, 256), np.uint16)
    for i in range(256):
        c = i
        for _ in range(8):
            c = ((c << 1) ^ 0x07) & 0xFF if c & 0x80 else (c << 1) & 0xFF
        crc8[i] = c
        c = i << 8
        for _ in range(8):
            c = ((c << 1) ^ 0x8005) & 0xFFFF if c & 0x8000 else (c << 1) & 0xFFFF
        crc16[0, i] = c
    for k in range(1, 4):
        prev = crc16[k - 1].astype(np.uint32)
        crc16[k] = ((prev << 8) & 0xFFFF) ^ crc16[0][prev >> 8]
    return crc8, crc16.reshape(-1)


CRC8, CRC16 = _crc_tables()


@dataclass(frozen=True)
class StreamInfo:
    """A FLAC file's STREAMINFO, and where its first audio frame starts."""

    sample_rate: int
    channels: int
    bits_per_sample: int
    total_samples: int  # per channel; 0 when the encoder did not know it
    min_block: int
    max_block: int
    audio_offset: int  # bytes from the start of the file


def parse_streaminfo(buf) -> StreamInfo:
    """Parse the metadata of a FLAC file held in ``buf`` (bytes-like). Raises ``ValueError``
    when it is not FLAC or its metadata is cut short."""
    mv = memoryview(buf).cast("B")
    n = len(mv)
    pos = 0
    if n >= 10 and bytes(mv[:3]) == b"ID3":  # an ID3v2 tag in front, as libFLAC tolerates
        size = (mv[6] << 21) | (mv[7] << 14) | (mv[8] << 7) | mv[9]
        pos = 10 + size + (10 if mv[5] & 0x10 else 0)
    if bytes(mv[pos : pos + 4]) != b"fLaC":
        raise ValueError("not a FLAC stream (no 'fLaC' marker)")
    pos += 4
    info = None
    while True:
        if pos + 4 > n:
            raise ValueError("FLAC metadata is cut short")
        head = mv[pos]
        length = (mv[pos + 1] << 16) | (mv[pos + 2] << 8) | mv[pos + 3]
        kind = head & 0x7F
        if kind == 0:
            if length < 34 or pos + 4 + 34 > n:
                raise ValueError("FLAC STREAMINFO is cut short")
            b = bytes(mv[pos + 4 : pos + 4 + 18])
            min_block, max_block = struct.unpack(">HH", b[:4])
            (x,) = struct.unpack(">Q", b[10:18])
            info = dict(
                sample_rate=x >> 44,
                channels=((x >> 41) & 7) + 1,
                bits_per_sample=((x >> 36) & 31) + 1,
                total_samples=x & ((1 << 36) - 1),
                min_block=min_block,
                max_block=max_block,
            )
        elif kind == 127:
            raise ValueError("invalid FLAC metadata block type 127")
        pos += 4 + length
        if head & 0x80:
            break
    if info is None:
        raise ValueError("FLAC stream without STREAMINFO")
    if pos > n:
        raise ValueError("FLAC metadata is cut short")
    return StreamInfo(audio_offset=pos, **info)


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


def plan_batch(buf: np.ndarray, offsets: np.ndarray) -> Plan:
    """``buf``: uint8 holding the files back to back (``PAD`` spare bytes after the last);
    ``offsets``: int64 ``[B + 1]``, item ``i`` is ``buf[offsets[i]:offsets[i+1]]``."""
    b = len(offsets) - 1
    istart = np.zeros(b, np.int64)
    iend = np.zeros(b, np.int64)
    imeta = np.zeros((b, 6), np.int32)
    itotal = np.zeros(b, np.int64)
    ipcm = np.zeros(b, np.int64)
    iclaim = np.full(b, -1, np.int64)
    infos, cpu = [], {}
    pcm = 0
    claims = 0
    any_fixed = any_other = False
    cap = 64
    for i in range(b):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        try:
            si = parse_streaminfo(buf[lo:hi])
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
        elif si.bits_per_sample > MAX_BPS or si.bits_per_sample < 4:
            cpu[i] = f"{si.bits_per_sample}-bit samples"
        else:
            iend[i] = hi
            itotal[i] = si.total_samples
            ipcm[i] = pcm
            pcm += si.channels * si.total_samples
            if si.min_block == si.max_block >= 16:  # fixed block size: frame numbers
                frames = -(-si.total_samples // si.max_block)
                imeta[i, 4:] = (1, frames)
                iclaim[i] = claims
                claims += frames
                any_fixed = True
            else:
                any_other = True
            cap += si.total_samples // max(16, min(si.min_block or 16, si.max_block or 16)) + 2
    cap += int(offsets[-1]) // 4096  # room for false syncs (each is rejected later)
    lengths = [(inf.total_samples if inf is not None else 0) for inf in infos]
    return Plan(
        nbytes=int(offsets[-1]) + PAD,
        istart=istart,
        iend=iend,
        imeta=imeta,
        itotal=itotal,
        ipcm=ipcm,
        iclaim=iclaim,
        pcm_size=max(pcm, 1),
        claims_size=max(claims, 1),
        any_fixed=any_fixed,
        any_other=any_other,
        cap=int(cap),
        infos=infos,
        cpu=cpu,
        max_len=int(max(lengths, default=0)),
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

_MODULES: dict = {}
_LOCK = threading.Lock()


def _kernels(cupy):
    dev = cupy.cuda.Device().id
    with _LOCK:
        hit = _MODULES.get(dev)
        if hit is None:
            with open(KERNEL_FILE) as f:
                mod = cupy.RawModule(code=f.read(), options=("-std=c++14",))
            hit = (
                mod.get_function("flac_scan"),
                mod.get_function("flac_frames"),
                mod.get_function("flac_to_float"),
                cupy.asarray(CRC8),
                cupy.asarray(CRC16),
            )
            _MODULES[dev] = hit
    return hit


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
    mem = cupy.cuda.alloc_pinned_memory(max(b, 1) * 8)
    host = np.frombuffer(mem, np.uint64, b)
    cupy.cuda.runtime.memcpyAsync(
        host.ctypes.data, cover.data.ptr, b * 8, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr
    )
    done = cupy.cuda.Event(block=False, disable_timing=True)
    done.record(stream)
    return Launched(out, plan, host, done, (data, meta, imeta, flags, cand, n_cand, valid, cover,
                                           claims, pcm))


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
    job.inputs = ()
    if job.plan.max_len < out.shape[1]:
        out = out[:, : job.plan.max_len]
    return out, job.plan, left


def decode_on_gpu(buf: np.ndarray, offsets: np.ndarray, plan: Plan | None = None):
    """:func:`launch` then :func:`collect`: decode the FLAC files in ``buf`` now."""
    return collect(launch(buf, offsets, plan))


# ---------------------------------------------------------------------------------------------
# one file: its header, and libFLAC's decode of what the GPU leaves
# (windows of batches, read ahead and scheduled: avpipe.pipeline._flac_windows)
# ---------------------------------------------------------------------------------------------


def header_info(path: str):
    """``(frames, sample_rate, channels)`` from the file's first bytes (FLAC STREAMINFO), or
    ``None`` when that does not say (not FLAC, unknown length, huge metadata)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
        si = parse_streaminfo(head)
    except (OSError, ValueError):
        return None
    if si.total_samples <= 0:
        return None
    return si.total_samples, si.sample_rate, si.channels


def _cpu_decode(path, max_samples):
    """libFLAC through soundfile, channels averaged: the CPU path for what the GPU leaves."""
    import soundfile as sf

    x, _ = sf.read(path, dtype="float32", always_2d=True)
    if x.shape[0] > max_samples:
        raise ValueError(f"{x.shape[0]} samples, more than max_samples={max_samples}: skipped")
    if x.shape[0] == 0:
        raise ValueError("no audio samples")
    return x[:, 0] if x.shape[1] == 1 else x.mean(axis=1)
