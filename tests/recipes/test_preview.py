"""``avpipe preview``: contact sheets of the video and RNN-T feeds (PNG size, tiles, masks,
text)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from paths import REPO  # noqa: E402
from PIL import Image  # noqa: E402

from avpipe.recipes.preview import (  # noqa: E402
    BACKGROUND,
    MASK_COLOUR,
    PAD,
    preview_rnnt,
    preview_video,
)

ROOT = Path(REPO)
LABELS = ROOT / "samples" / "video" / "labels.csv"
MANIFEST = ROOT / "samples" / "speech" / "manifest.jsonl"


def _region(img, box):
    x0, t, r, b = box
    return img[t:b, x0:r]


def _text_pixels(img, box):
    reg = _region(img, box).astype(int)
    return int((reg.min(axis=-1) > 150).sum())  # light (text) pixels on the dark strip


def test_video_sheet_tiles_and_text(tmp_path):
    out = tmp_path / "v.png"
    sheet = preview_video(LABELS, out, items=3, frames=4, clip_length=8, stride=2, crop_size=64,
                          seed=1)
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape[1::-1] == sheet.size
    assert sheet.size[0] == max(PAD + 4 * (64 + PAD), 320)
    assert len(sheet.tiles) == 3 and all(len(r) == 4 for r in sheet.tiles)
    bg = np.array(BACKGROUND)
    for row in sheet.tiles:
        for box in row:
            reg = _region(img, box)
            assert reg.shape == (64, 64, 3)
            assert (np.abs(reg.astype(int) - bg).sum(-1) > 0).mean() > 0.9  # drawn, not empty
    for box, cap in zip(sheet.text_boxes, sheet.captions):
        assert _text_pixels(img, box) > 50
        assert cap[1].endswith((".mp4", ".webm", ".avi")) and cap[0].split()[0] in (
            "circles", "squares")
    # the tiles show RGB frames (un-normalized): the samples' coloured shapes on a gradient
    assert img.max() > 150


def test_video_sheet_eval_shows_views(tmp_path):
    sheet = preview_video(LABELS, tmp_path / "e.png", items=3, frames=2, clip_length=4,
                          crop_size=48, train=False)
    assert [c[0].split("view ")[1] for c in sheet.captions] == ["0", "1", "2"]


def _mask_cells(img, sheet):
    m = np.zeros(len(sheet.tiles), int)
    for k, (box,) in enumerate(sheet.tiles):
        reg = _region(img, box)
        m[k] = int((reg == np.array(MASK_COLOUR)).all(-1).sum())
    return m


def test_rnnt_sheet_marks_spec_augment_masks(tmp_path):
    out = tmp_path / "r.png"
    sheet = preview_rnnt(MANIFEST, out, items=3, seed=2)
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape[1::-1] == sheet.size and len(sheet.tiles) == 3
    masked = _mask_cells(img, sheet)
    assert (masked > 0).all()
    for (box,), cap in zip(sheet.tiles, sheet.captions):
        assert box[3] - box[1] == 80 * 2  # 80 mel bins, 2 px each
        n = int(cap[1].split("(")[-1].split(" frames")[0])
        assert box[2] - box[0] == n
        cells = int(cap[1].split(", ")[-1].split(" masked")[0])
        assert cells > 0
    # masked cells cover whole frames (time masks) and whole bins (frequency masks)
    reg = _region(img, sheet.tiles[0][0])
    is_mask = (reg == np.array(MASK_COLOUR)).all(-1)
    assert is_mask.all(axis=0).any() and is_mask.all(axis=1).any()
    for box in sheet.text_boxes:
        assert _text_pixels(img, box) > 50
    # eval: no SpecAugment, no mask colour anywhere
    ev = preview_rnnt(MANIFEST, tmp_path / "e.png", items=3, seed=2, train=False)
    img2 = np.asarray(Image.open(ev.path).convert("RGB"))
    assert not (img2 == np.array(MASK_COLOUR)).all(-1).any()
    assert all(" s  |  " in c[0] for c in ev.captions)


def test_preview_command_writes_the_png(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = tmp_path / "sheet.png"
    r = subprocess.run([sys.executable, "-m", "avpipe", "preview", "rnnt", str(MANIFEST), "--out",
                        str(out), "--items", "2", "--eval"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert "2 items" in r.stdout and Image.open(out).size[0] >= 320
    r = subprocess.run([sys.executable, "-m", "avpipe", "preview", "video", str(LABELS), "--out",
                        str(tmp_path / "v.png"), "--items", "2", "--frames", "3",
                        "--clip-length", "4", "--crop-size", "32", "--seed", "3"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert Image.open(tmp_path / "v.png").size == (320, 2 * (32 + 2 * 14 + 4 + PAD) + PAD)
