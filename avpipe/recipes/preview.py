"""Contact sheets of a feed's first items, to check a pipeline by looking at it (``avpipe
preview``).

* :func:`preview_video`: one row per item of :func:`~avpipe.recipes.video_classification`'s
  first batch: ``frames`` of its clip (evenly picked from the ``clip_length``), after the
  augmentation, un-normalized back to RGB; under the row a text strip with the label, the path
  (and in eval the video's row and the view).
* :func:`preview_rnnt`: one row per item of :func:`~avpipe.recipes.rnnt_feed`'s first batch:
  its log-mel spectrogram (low frequencies at the bottom, each mel bin two pixels high, each
  frame one pixel wide, black -> red -> yellow), SpecAugment's masked cells drawn in
  :data:`MASK_COLOUR` (a colour the spectrogram ramp never uses); under it the transcript and
  the duration.

The drawing is Pillow's (``pip install avpipe[preview]``), imported when a sheet is drawn. Both
return a :class:`Sheet`: the PNG's path and size and where each tile and text strip lies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["preview_video", "preview_rnnt", "Sheet", "MASK_COLOUR", "BACKGROUND"]

BACKGROUND = (24, 24, 24)
TEXT_COLOUR = (240, 240, 240)
MASK_COLOUR = (0, 200, 255)  # never produced by the spectrogram ramp (its blue stays <= 40)
PAD = 6
LINE = 14  # pixels per text line (Pillow's default bitmap font)
MEL_SCALE = 2  # pixels per mel bin


@dataclass
class Sheet:
    """A written contact sheet: ``path``, ``size`` (width, height), ``tiles`` (per item the
    (left, top, right, bottom) boxes of its images), ``text_boxes`` (per item its text strip's
    box) and ``captions`` (per item the lines written there)."""

    path: str
    size: tuple
    tiles: list = field(default_factory=list)
    text_boxes: list = field(default_factory=list)
    captions: list = field(default_factory=list)


def _pil():
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("avpipe preview draws with Pillow: pip install 'avpipe[preview]'") \
            from e
    return Image, ImageDraw, ImageFont


def _host(x):
    if hasattr(x, "get"):  # cupy
        return x.get()
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _fit(draw, font, text, width):
    """``text`` cut (with an ellipsis) to fit ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def _first_batch(feed):
    it = iter(feed)
    try:
        return next(it)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        feed.close()


def _draw(rows, captions, out, width):
    """``rows``: per item a list of (x offset, HxWx3 uint8 image); ``captions``: per item a
    list of text lines under its images. Writes the PNG; returns the :class:`Sheet`."""
    Image, ImageDraw, ImageFont = _pil()
    font = ImageFont.load_default()
    heights = [max(im.shape[0] for _, im in r) if r else 0 for r in rows]
    text_h = [LINE * len(c) + 4 for c in captions]
    H = PAD + sum(h + t + PAD for h, t in zip(heights, text_h))
    sheet = Image.new("RGB", (width, H), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    tiles, boxes, y = [], [], PAD
    for r, cap, h, th in zip(rows, captions, heights, text_h):
        row_tiles = []
        for x0, im in r:
            sheet.paste(Image.fromarray(np.ascontiguousarray(im)), (x0, y))
            row_tiles.append((x0, y, x0 + im.shape[1], y + im.shape[0]))
        tiles.append(row_tiles)
        ty = y + h + 2
        for k, line in enumerate(cap):
            draw.text((PAD, ty + k * LINE), _fit(draw, font, line, width - 2 * PAD),
                      fill=TEXT_COLOUR, font=font)
        boxes.append((PAD, ty, width - PAD, ty + th - 2))
        y += h + th + PAD
    out = os.fspath(out)
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    sheet.save(out, format="PNG")
    return Sheet(path=out, size=sheet.size, tiles=tiles, text_boxes=boxes, captions=captions)


# --- video ---------------------------------------------------------------------------------------


def preview_video(labels_csv, out, *, items=4, frames=8, seed=0, train=True, clip_length=16,
                  stride=4, crop_size=224, device=None, **feed_kwargs):
    """A contact sheet of the first ``items`` items of :func:`video_classification` (module
    docstring). ``frames``: frames shown per clip (at most ``clip_length``). In eval the items
    are views (the first video's views first). ``feed_kwargs`` go to the recipe."""
    from ..ops.image import IMAGENET_MEAN, IMAGENET_STD
    from .video import video_classification

    feed = video_classification(labels_csv, clip_length=clip_length, stride=stride,
                                crop_size=crop_size, batch_size=int(items), train=train,
                                seed=seed, device=device, prefetch=0, **feed_kwargs)
    classes = feed.classes
    b = _first_batch(feed)
    clips = _host(b.clips).astype(np.float32)  # [B, T, 3, S, S]
    labels = _host(b.labels).tolist()
    mean = np.asarray(IMAGENET_MEAN, np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(IMAGENET_STD, np.float32).reshape(1, 3, 1, 1)
    nf = max(1, min(int(frames), clips.shape[1]))
    pick = np.round(np.linspace(0, clips.shape[1] - 1, nf)).astype(int)
    S = clips.shape[-1]
    rows, captions = [], []
    for k in range(clips.shape[0]):
        rgb = clips[k, pick] * std + mean  # [nf, 3, S, S] in 0..1
        rgb = np.clip(np.rint(rgb * 255.0), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
        rows.append([(PAD + j * (S + PAD), rgb[j]) for j in range(nf)])
        head = f"{classes[labels[k]]} (label {labels[k]})"
        if not train:
            head += f"  video {int(_host(b.video_index)[k])}, view {int(_host(b.view)[k])}"
        captions.append([head, str(b.paths[k])])
    width = max(PAD + nf * (S + PAD), 320)
    return _draw(rows, captions, out, width)


# --- rnnt ----------------------------------------------------------------------------------------


def _ramp(v):
    """[...] in 0..1 -> [..., 3] uint8: black -> red -> yellow (blue <= 40)."""
    v = np.clip(v, 0.0, 1.0)
    r = np.clip(2.0 * v, 0, 1)
    g = np.clip(2.0 * v - 1.0, 0, 1)
    b = 0.16 * v * (1 - v) * 4  # a tint, at most 0.16
    return np.rint(np.stack([r, g, b], axis=-1) * 255).astype(np.uint8)


def preview_rnnt(manifest, out, *, items=4, seed=0, train=True, device=None, **feed_kwargs):
    """A contact sheet of the first ``items`` items of :func:`rnnt_feed` (module docstring).
    ``train``: the feed's ``training`` (speed perturbation, dither, SpecAugment); a cell is
    drawn as masked where SpecAugment set it to exactly 0 inside the item's length."""
    from .rnnt import rnnt_feed

    feed = rnnt_feed(manifest, batch_size=int(items), seed=seed, training=bool(train),
                     device=device, prefetch=0, **feed_kwargs)
    b = _first_batch(feed)
    feats = _host(b.features).astype(np.float32)  # [B, n_mels, T]
    lens = _host(b.feature_lengths).astype(np.int64)
    rows, captions = [], []
    width = 320
    for k in range(feats.shape[0]):
        n = int(lens[k])
        f = feats[k, :, :n]
        masked = f == 0.0
        live = f[~masked]
        lo, hi = (np.percentile(live, 1), np.percentile(live, 99)) if live.size else (0.0, 1.0)
        img = _ramp((f - lo) / max(hi - lo, 1e-6))
        img[masked] = MASK_COLOUR
        img = np.repeat(img[::-1], MEL_SCALE, axis=0)  # low frequencies at the bottom
        if img.shape[1] == 0:
            img = np.zeros((img.shape[0], 1, 3), np.uint8)
        rows.append([(PAD, img)])
        width = max(width, PAD * 2 + img.shape[1])
        dur = b.durations[k]
        dur_s = f"{dur:.2f} s" if dur else f"{n} frames"
        captions.append([f"{dur_s}  |  {b.transcripts[k]}",
                         f"{b.paths[k]}  ({n} frames, {int(masked.sum())} masked cells)"])
    return _draw(rows, captions, out, width)
