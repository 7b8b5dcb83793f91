"""The benchmarks' data, made here, deterministically, once per data folder.

:func:`anchor_data`: the shared workloads the GPU suite and its anchors run on: H.264 (and
HEVC) 640x360 30 fps clips of 300 frames with moving gradients, a panning texture, moving blobs
and noise (x264 crf 23, about 1.3 Mbit/s); speech-like FLAC, 16 kHz mono, 2-16 s, with a NeMo
manifest; 500x375 JPEG / PNG / TIFF / JPEG 2000 images. Every file is a pure function of its
kind and index (seeded generators; the encoders' thread counts fixed so the bitstreams do not
depend on the machine).

:func:`cpu_flac`: the CPU suites' speech-like FLAC (a lighter generator, seeded by index) and
their manifest; :func:`cpu_clip_videos`: the CPU clip workload's 16 H.264 files with B-frames.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np

from benchmarks.harness import log

SEED = 20240601
VID_W, VID_H, VID_FPS = 640, 360, 30
SR = 16000
IMG_W, IMG_H = 500, 375
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
CROP = 224
CLIP_LEN, CLIP_STRIDE = 16, 4
CLIP_SPAN = (CLIP_LEN - 1) * CLIP_STRIDE + 1          # 61 frames covered by one clip

SPEC_FULL = dict(h264=32, hevc=8, frames=300, audio=512, jpeg=512, other=64)
SPEC_QUICK = dict(h264=4, hevc=2, frames=90, audio=32, jpeg=32, other=8)

# Synthetic content knobs: noise + panning texture keep x264 at ~1.3 Mbit/s (crf 23).
NOISE_SIGMA = 7.0
TEXTURE_AMP = 30.0
# How the non-JPEG image formats are written (PIL keyword arguments).
IMAGE_FORMATS = {
    'jpeg': ('jpg', 'JPEG', dict(quality=90)),
    'png': ('png', 'PNG', dict()),                      # zlib level 6
    'tiff': ('tif', 'TIFF', dict()),                    # uncompressed (LZW inflates noisy content)
    'jp2': ('jp2', 'JPEG2000', dict(irreversible=True, quality_mode='rates', quality_layers=[10])),
}
WORDS = ('the a of to and in is it you that he was for on are with as his they be at one have this '
         'from or had by word but what some we can out other were all there when up use your how said '
         'an each she which do their time if will way about many then them write would like so these '
         'her long make thing see him two has look more day could go come did number sound no most '
         'people my over know water than call first who may down side been now find').split()



# --------------------------------------------------------------------------------------------
# Synthetic content
# --------------------------------------------------------------------------------------------

def lowpass_texture(rng, h, w, cutoff=0.08):
    """Unit-variance smooth random texture (gaussian low-pass of white noise)."""
    z = rng.standard_normal((h, w)).astype(np.float32)
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    spec = np.fft.rfft2(z) * np.exp(-(fx ** 2 + fy ** 2) / (2 * cutoff ** 2))
    t = np.fft.irfft2(spec, s=(h, w)).astype(np.float32)
    return t / (t.std() + 1e-6)


def make_scene(rng, w, h, nblobs=6, pad=400):
    """Random parameters of a scene: moving gradients, a panning texture, moving blobs."""
    return dict(
        freq=rng.uniform(0.5, 2.0, size=(3, 2)), vel=rng.uniform(-0.02, 0.02, size=(3, 2)),
        phase=rng.uniform(0, 2 * np.pi, size=3),
        tex=lowpass_texture(rng, h + pad, w + pad), pan=rng.uniform(-1.5, 1.5, size=2), pad=pad,
        pos=rng.uniform([0, 0], [w, h], size=(nblobs, 2)), vel_blob=rng.uniform(-4, 4, size=(nblobs, 2)),
        rad=rng.uniform(min(w, h) * 0.05, min(w, h) * 0.18, size=nblobs),
        col=rng.uniform(0, 255, size=(nblobs, 3)))


def render(scene, t, w, h, rng):
    """Frame t of a scene as HxWx3 uint8, with fresh gaussian noise."""
    y = np.linspace(0, 1, h, dtype=np.float32)
    x = np.linspace(0, 1, w, dtype=np.float32)
    pad = scene['pad']
    ox = int((pad / 2 + scene['pan'][0] * t) % pad)
    oy = int((pad / 2 + scene['pan'][1] * t) % pad)
    tex = scene['tex'][oy:oy + h, ox:ox + w] * TEXTURE_AMP
    img = np.empty((h, w, 3), np.float32)
    for c in range(3):
        (fx, fy), (vx, vy) = scene['freq'][c], scene['vel'][c]
        img[..., c] = 128 + 70 * np.outer(np.cos(2 * np.pi * (fy * y + vy * t)),
                                          np.sin(2 * np.pi * (fx * x + vx * t) + scene['phase'][c])) + tex
    for (px, py), (vx, vy), r, col in zip(scene['pos'], scene['vel_blob'], scene['rad'], scene['col']):
        cx = (px + vx * t) % (w + 2 * r) - r
        cy = (py + vy * t) % (h + 2 * r) - r
        x0, x1 = int(max(cx - 2 * r, 0)), int(min(cx + 2 * r, w))
        y0, y1 = int(max(cy - 2 * r, 0)), int(min(cy + 2 * r, h))
        if x1 <= x0 or y1 <= y0:
            continue
        gx = np.arange(x0, x1, dtype=np.float32)[None, :] - cx
        gy = np.arange(y0, y1, dtype=np.float32)[:, None] - cy
        a = np.exp(-(gx * gx + gy * gy) / (2 * (r * 0.6) ** 2))[..., None]
        img[y0:y1, x0:x1] = img[y0:y1, x0:x1] * (1 - a) + col * a
    img += rng.standard_normal((h, w, 3), dtype=np.float32) * NOISE_SIGMA
    return np.clip(img, 0, 255).astype(np.uint8)


def smooth_walk(rng, n_ctrl, n, lo, hi):
    """Piecewise-linear random curve of n samples through n_ctrl points in [lo, hi]."""
    ctrl = rng.uniform(lo, hi, size=max(2, n_ctrl))
    return np.interp(np.linspace(0, len(ctrl) - 1, n), np.arange(len(ctrl)), ctrl).astype(np.float32)


def audio_duration(i):
    return round(float(np.random.default_rng([SEED, 30, i]).uniform(2.0, 16.0)), 3)


def synth_speech(i):
    """Speech-like mono float32 signal: harmonics of a gliding f0 (90-250 Hz) shaped by three
    moving formants, amplitude-modulated at a ~4 Hz syllable rate with pauses, plus noise at -30 dB."""
    rng = np.random.default_rng([SEED, 3, i])
    dur = audio_duration(i)
    n = int(round(dur * SR))
    t = np.arange(n, dtype=np.float32) / SR
    f0 = rng.uniform(90, 250) * (1 + 0.25 * np.sin(2 * np.pi * rng.uniform(0.2, 0.8) * t + rng.uniform(0, 6.3)))
    f0 = np.clip(f0 * smooth_walk(rng, int(dur * 3), n, 0.85, 1.15), 90, 250)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    formants = [smooth_walk(rng, int(dur * 4), n, lo, hi) for lo, hi in ((300, 900), (900, 2300), (2300, 3200))]
    bandwidths, gains = (90.0, 130.0, 180.0), (1.0, 0.5, 0.25)
    x = np.zeros(n, np.float32)
    for k in range(1, int(SR / 2 / 90)):
        fk = k * f0
        alive = fk < SR / 2 - 200
        if not alive.any():
            break
        env = sum(g * np.exp(-0.5 * ((fk - F) / bw) ** 2) for F, bw, g in zip(formants, bandwidths, gains))
        x += np.where(alive, env / np.sqrt(k), 0) * np.sin(k * phase)
    syllables = 0.5 * (1 - np.cos(2 * np.pi * rng.uniform(3.0, 5.0) * t + rng.uniform(0, 6.3)))
    words = smooth_walk(rng, int(dur * 1.5), n, -0.5, 1.5) > 0
    x *= syllables ** 1.5 * words
    x /= np.sqrt(np.mean(x ** 2)) + 1e-9
    x += rng.standard_normal(n).astype(np.float32) * 10 ** (-30 / 20)
    return np.clip(0.1 * x, -1, 1).astype(np.float32)


def transcript(i):
    rng = np.random.default_rng([SEED, 31, i])
    return ' '.join(rng.choice(WORDS, size=max(1, int(audio_duration(i) * 2.5))))


# --------------------------------------------------------------------------------------------
# Data generation (cached, one process per file)
# --------------------------------------------------------------------------------------------

def data_plan(data_dir, spec):
    """Paths of every file the benchmarks use, by kind."""
    vdir = os.path.join(data_dir, f"videos_{VID_W}x{VID_H}_{spec['frames']}f")
    plan = {
        'h264': [os.path.join(vdir, f'h264_{i:03d}.mp4') for i in range(spec['h264'])],
        'hevc': [os.path.join(vdir, f'hevc_{i:03d}.mp4') for i in range(spec['hevc'])],
        'audio': [os.path.join(data_dir, 'audio_flac_16k', f'utt_{i:04d}.flac') for i in range(spec['audio'])],
    }
    for kind, (ext, _, _) in IMAGE_FORMATS.items():
        count = spec['jpeg'] if kind == 'jpeg' else spec['other']
        plan[kind] = [os.path.join(data_dir, 'images', kind, f'img_{i:04d}.{ext}') for i in range(count)]
    return plan


def write_video(path, codec, index, n_frames):
    import av
    rng = np.random.default_rng([SEED, 1 if codec == 'libx264' else 2, index])
    scene = make_scene(rng, VID_W, VID_H)
    tmp = path + '.tmp'
    with av.open(tmp, 'w', format='mp4') as out:
        st = out.add_stream(codec, rate=VID_FPS)
        st.width, st.height, st.pix_fmt = VID_W, VID_H, 'yuv420p'
        # Fixed thread counts keep the bitstream independent of the machine's core count.
        if codec == 'libx264':
            st.options = {'preset': 'medium', 'crf': '23', 'threads': '2'}
        else:
            st.options = {'preset': 'medium', 'crf': '23',
                          'x265-params': 'log-level=error:pools=2:frame-threads=1'}
        for t in range(n_frames):
            frame = av.VideoFrame.from_ndarray(render(scene, t, VID_W, VID_H, rng), format='rgb24')
            for pkt in st.encode(frame):
                out.mux(pkt)
        for pkt in st.encode(None):
            out.mux(pkt)
    os.replace(tmp, path)


def write_audio(path, index):
    import soundfile as sf
    tmp = path + '.tmp'
    sf.write(tmp, synth_speech(index), SR, subtype='PCM_16', format='FLAC')
    os.replace(tmp, path)


def write_image(path, kind, index):
    from PIL import Image, features
    _, pil_format, kwargs = IMAGE_FORMATS[kind]
    # PNG/TIFF/JP2 file i holds the same picture in each format (JPEGs use their own seeds).
    rng = np.random.default_rng([SEED, 4, index] if kind == 'jpeg' else [SEED, 5, index])
    img = render(make_scene(rng, IMG_W, IMG_H, pad=8), 0, IMG_W, IMG_H, rng)
    tmp = path + '.tmp'
    if kind == 'jp2' and not features.check('jpg_2000'):
        # PIL built without OpenJPEG: FFmpeg's native encoder (JP2 container, lossless).
        import av
        cc = av.CodecContext.create('jpeg2000', 'w')
        cc.width, cc.height, cc.pix_fmt = IMG_W, IMG_H, 'rgb24'
        frame = av.VideoFrame.from_ndarray(img, format='rgb24')
        data = b''.join(bytes(p) for p in cc.encode(frame) + cc.encode(None))
        with open(tmp, 'wb') as f:
            f.write(data)
    else:
        Image.fromarray(img).save(tmp, format=pil_format, **kwargs)
    os.replace(tmp, path)


def _gen_one(task):
    kind, index, path, n_frames = task
    os.makedirs(os.path.dirname(path), exist_ok=True)
    t0 = time.time()
    if kind == 'h264':
        write_video(path, 'libx264', index, n_frames)
    elif kind == 'hevc':
        write_video(path, 'libx265', index, n_frames)
    elif kind == 'audio':
        write_audio(path, index)
    else:
        write_image(path, kind, index)
    return kind, time.time() - t0


def gen_data(data_dir, spec, generate=True):
    """Create whatever files of the plan are missing (unless generate=False); return the paths
    that exist, by kind, plus audio durations and the manifest path."""
    plan = data_plan(data_dir, spec)
    priority = {'hevc': 0, 'h264': 1, 'audio': 2}   # longest jobs first
    tasks = [(kind, i, p, spec['frames']) for kind in plan for i, p in enumerate(plan[kind])
             if generate and not os.path.exists(p)]
    tasks.sort(key=lambda tk: (priority.get(tk[0], 3), -audio_duration(tk[1]) if tk[0] == 'audio' else 0))
    if tasks:
        if importlib.util.find_spec('PIL') is None:
            log('gen_data: PIL missing, skipping images')
            tasks = [tk for tk in tasks if tk[0] in ('h264', 'hevc', 'audio')]
        workers = min(16, os.cpu_count() or 1)
        log(f'gen_data: generating {len(tasks)} files in {data_dir} with {workers} processes ...')
        t0, done, failed = time.time(), 0, collections.Counter()
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(_gen_one, tk): tk for tk in tasks}
            for fut in as_completed(futures):
                done += 1
                try:
                    fut.result()
                except Exception as e:  # one bad writer must not stop the rest
                    kind = futures[fut][0]
                    if not failed[kind]:
                        log(f'gen_data: {kind} failed: {type(e).__name__}: {e}')
                    failed[kind] += 1
                if done % max(1, len(tasks) // 10) == 0 or done == len(tasks):
                    log(f'gen_data: {done}/{len(tasks)} files, {time.time() - t0:.0f} s')
        if failed:
            log(f'gen_data: failures: {dict(failed)}')
    data = {kind: [p for p in paths if os.path.exists(p)] for kind, paths in plan.items()}
    audio_ids = [i for i, p in enumerate(plan['audio']) if os.path.exists(p)]
    data['durations'] = [audio_duration(i) for i in audio_ids]
    data['frames'] = spec['frames']
    manifest = os.path.join(data_dir, 'audio_flac_16k', f"manifest_{len(audio_ids)}.json")
    if generate and audio_ids and not os.path.exists(manifest):
        with open(manifest + '.tmp', 'w') as f:
            for i in audio_ids:
                f.write(json.dumps({'audio_filepath': os.path.abspath(plan['audio'][i]),
                                    'duration': audio_duration(i), 'text': transcript(i)}) + '\n')
        os.replace(manifest + '.tmp', manifest)
    data['manifest'] = manifest
    return data


def describe_data(data):
    """Counts, sizes and video bitrates, for the log and baseline.json."""
    out = {}
    for kind in ('h264', 'hevc', 'audio', 'jpeg', 'png', 'tiff', 'jp2'):
        paths = data.get(kind, [])
        size = sum(os.path.getsize(p) for p in paths)
        d = {'files': len(paths), 'MB': round(size / 1e6, 1)}
        if paths and kind in ('h264', 'hevc'):
            seconds = len(paths) * data['frames'] / VID_FPS
            d['mean_Mbit_s'] = round(size * 8 / seconds / 1e6, 2)
        if paths and kind == 'audio':
            d['audio_seconds'] = round(sum(data['durations']), 1)
        if paths and kind not in ('h264', 'hevc', 'audio'):
            d['mean_KB'] = round(size / len(paths) / 1e3, 1)
        out[kind] = d
    out['total_MB'] = round(sum(v['MB'] for v in out.values()), 1)
    return out




def anchor_data(data_dir: str, quick: bool = False) -> dict:
    """The shared data in ``data_dir`` (made where missing): paths by kind, the audio
    durations, the manifest and the frame count (:func:`gen_data`)."""
    os.makedirs(data_dir, exist_ok=True)
    t0 = time.time()
    data = gen_data(data_dir, SPEC_QUICK if quick else SPEC_FULL)
    if time.time() - t0 > 1:  # made now, not found
        log(f"data: {json.dumps(describe_data(data))} ({time.time() - t0:.0f} s)")
    return data


# --------------------------------------------------------------------------------------------
# The CPU suites' own data
# --------------------------------------------------------------------------------------------

def _cpu_utterance(args):
    """Speech-like 16 kHz FLAC of 2-16 s, seeded by index: harmonics of a wobbling f0 under two
    formants, syllable-rate amplitude modulation, a little noise."""
    path, i = args
    import soundfile as sf

    rng = np.random.default_rng([7, i])
    n = int(rng.uniform(2.0, 16.0) * SR)
    t = np.arange(n) / SR
    f0 = rng.uniform(90, 250) * (1 + 0.2 * np.sin(2 * np.pi * rng.uniform(0.2, 0.8) * t))
    ph = 2 * np.pi * np.cumsum(f0) / SR
    x = np.zeros(n)
    for k in range(1, 40):
        fk = k * f0
        env = np.exp(-0.5 * ((fk - 700) / 200) ** 2) + 0.5 * np.exp(-0.5 * ((fk - 1800) / 300) ** 2)
        x += np.where(fk < SR / 2 - 200, env / math.sqrt(k), 0) * np.sin(k * ph)
    x *= (0.5 - 0.5 * np.cos(2 * np.pi * rng.uniform(3, 5) * t)) ** 1.5
    x = 0.1 * x / (np.sqrt(np.mean(x ** 2)) + 1e-9) + 0.003 * rng.standard_normal(n)
    sf.write(path + ".tmp", np.clip(x, -1, 1).astype(np.float32), SR, subtype="PCM_16",
             format="FLAC")
    os.replace(path + ".tmp", path)


def cpu_flac(data_dir: str, count: int) -> dict:
    """``count`` FLAC files in ``data_dir/flac`` and their NeMo manifest
    ``data_dir/manifest_<count>.jsonl``: ``{"files", "durations", "manifest"}``."""
    import soundfile as sf

    d = os.path.join(data_dir, "flac")
    os.makedirs(d, exist_ok=True)
    files = [os.path.join(d, f"utt_{i:04d}.flac") for i in range(count)]
    todo = [(p, i) for i, p in enumerate(files) if not os.path.exists(p)]
    if todo:
        log(f"data: generating {len(todo)} FLAC files in {d}")
        with ProcessPoolExecutor(min(4, os.cpu_count() or 1)) as ex:
            list(ex.map(_cpu_utterance, todo, chunksize=4))
    durs = [sf.info(p).frames / SR for p in files]
    manifest = os.path.join(data_dir, f"manifest_{count}.jsonl")
    if not os.path.exists(manifest):
        with open(manifest + ".tmp", "w") as f:
            for i, (p, dur) in enumerate(zip(files, durs)):
                f.write(json.dumps({"audio_filepath": p, "duration": dur,
                                    "text": f"utterance number {i}"}) + "\n")
        os.replace(manifest + ".tmp", manifest)
    return {"files": files, "durations": durs, "manifest": manifest}


def read_manifest(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


CLIP_VIDEO_FILES, CLIP_VIDEO_FRAMES = 16, 240
CLIP_X264 = "bframes=3:keyint=60:min-keyint=30:threads=1"  # fixed threads: the same bytes anywhere


def _clip_frame(rng_seed: int, t: int):
    """Frame ``t`` of file ``rng_seed``: drifting gradients, moving boxes and a little noise."""
    import numpy as np

    rng = np.random.default_rng([rng_seed, 7])
    boxes = rng.integers(0, 255, size=(6, 5))
    y, x = np.mgrid[0:VID_H, 0:VID_W].astype(np.int32)
    img = np.stack([(x + 3 * t) % 256, (y * 2 + t) % 256, (x + y + 5 * t) % 256], -1)
    for k, (bx, by, c, vx, vy) in enumerate(boxes):
        cx = int(bx * VID_W / 255 + (vx - 128) / 16 * t) % VID_W
        cy = int(by * VID_H / 255 + (vy - 128) / 32 * t) % VID_H
        img[cy:cy + 48, cx:cx + 64] = (c, 255 - c, (c * (k + 1)) % 256)
    noise = np.random.default_rng([rng_seed, t]).integers(0, 12, size=(VID_H, VID_W, 1))
    return (img + noise).clip(0, 255).astype(np.uint8)


def cpu_clip_videos(data_dir: str) -> list[str]:
    """The CPU clip workload's 16 H.264 640x360 files with B-frames in ``data_dir/cpu_clips``
    (made once; a finished file is never rewritten)."""
    folder = os.path.join(data_dir, "cpu_clips")
    import av

    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in range(CLIP_VIDEO_FILES):
        p = os.path.join(folder, f"h264_{i:02d}.mp4")
        paths.append(p)
        if os.path.exists(p):
            continue
        tmp = p + ".tmp"
        with av.open(tmp, "w", format="mp4") as out:
            st = out.add_stream("libx264", rate=VID_FPS)
            st.width, st.height, st.pix_fmt = VID_W, VID_H, "yuv420p"
            st.options = {"preset": "veryfast", "crf": "23", "x264-params": CLIP_X264}
            for t in range(CLIP_VIDEO_FRAMES):
                fr = av.VideoFrame.from_ndarray(_clip_frame(i, t), format="rgb24")
                for pkt in st.encode(fr):
                    out.mux(pkt)
            for pkt in st.encode(None):
                out.mux(pkt)
        os.replace(tmp, p)
    return paths


