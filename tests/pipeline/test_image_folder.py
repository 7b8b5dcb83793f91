"""avpipe.pipeline.ImageFolder: class folders -> batches of images and labels."""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
from PIL import Image  # noqa: E402

from avpipe.errors import CorruptDataError  # noqa: E402
from avpipe.ops import image as I  # noqa: E402
from avpipe.pipeline import ImageFolder  # noqa: E402


def _img(value, h=24, w=32):
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = value
    img[..., 1] = np.arange(w, dtype=np.uint8)[None, :] * 3
    return img


@pytest.fixture
def tree(tmp_path):
    # cat: 3 images, dog: 2 images (one in a sub-folder), plus a non-image file
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog" / "sub").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(_img(10 + i)).save(tmp_path / "cat" / f"c{i}.png")
    Image.fromarray(_img(100)).save(tmp_path / "dog" / "d0.png")
    Image.fromarray(_img(101, 30, 20)).save(tmp_path / "dog" / "sub" / "d1.tif")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    return tmp_path


def test_classes_samples_and_batches(tree):
    ds = ImageFolder(tree, batch_size=2, device="cpu")
    assert ds.classes == ["cat", "dog"]
    assert [lab for _, lab in ds.samples] == [0, 0, 0, 1, 1]
    assert len(ds) == 3
    batches = list(ds)
    assert [len(b.paths) for b in batches] == [2, 2, 1]
    b0 = batches[0]
    assert isinstance(b0.images, np.ndarray) and b0.images.shape == (2, 24, 32, 3)
    np.testing.assert_array_equal(b0.images[1], _img(11))
    assert b0.labels.dtype == np.int64 and b0.labels.tolist() == [0, 0]
    assert batches[1].labels.tolist() == [0, 1]
    np.testing.assert_array_equal(batches[1].images[1], _img(100))
    assert batches[2].images.shape == (1, 30, 20, 3) and batches[2].labels.tolist() == [1]
    # different shapes in one batch: a list
    (whole,) = list(ImageFolder(tree, batch_size=8, device="cpu"))
    assert isinstance(whole.images, list) and len(whole.images) == 5
    assert whole.images[4].shape == (30, 20, 3)


def test_transform_shuffle_drop_last(tree):
    t = functools.partial(I.resize_crop_normalize, short_side=16, crop_size=16)
    ds = ImageFolder(tree, batch_size=2, device="cpu", transform=t, shuffle=True, seed=1,
                     drop_last=True)  # fmt: skip
    assert len(ds) == 2
    e1 = [p for b in ds for p in b.paths]
    e2 = [p for b in ds for p in b.paths]
    assert len(e1) == len(e2) == 4 and e1 != e2  # a new order each epoch
    again = ImageFolder(tree, batch_size=2, device="cpu", shuffle=True, seed=1, drop_last=True)
    assert [p for b in again for p in b.paths] == e1  # reproducible from the seed
    plain = [p for p, _ in ds.samples]
    assert e1 != plain[:4] or e2 != plain[:4]
    b = next(iter(ImageFolder(tree, batch_size=5, device="cpu", transform=t)))
    assert b.images.shape == (5, 3, 16, 16) and b.images.dtype == np.float16


def test_bad_image_skipped_and_reported(tree):
    bad = tree / "cat" / "zz_bad.png"
    bad.write_bytes((tree / "cat" / "c0.png").read_bytes()[:40])
    ds = ImageFolder(tree, batch_size=8, device="cpu")
    (b,) = list(ds)
    assert str(bad) not in b.paths and len(b.paths) == 5
    assert len(b.labels) == 5
    assert [p for p, _ in ds.errors] == [str(bad)]
    assert isinstance(ds.errors[0][1], CorruptDataError)
    with pytest.raises(CorruptDataError) as ei:
        list(ImageFolder(tree, batch_size=8, device="cpu", on_error="raise"))
    assert ei.value.source == str(bad)


def test_validation(tmp_path, tree):
    with pytest.raises(FileNotFoundError):
        ImageFolder(tmp_path / "missing")
    with pytest.raises(ValueError, match="batch_size"):
        ImageFolder(tree, batch_size=0, device="cpu")
    with pytest.raises(ValueError, match="on_error"):
        ImageFolder(tree, on_error="ignore", device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="class folders"):
        ImageFolder(empty, device="cpu")


@pytest.mark.gpu
def test_gpu_batches(tree):
    import cupy

    ds = ImageFolder(tree, batch_size=2, device="cuda")
    b0 = next(iter(ds))
    assert isinstance(b0.images, cupy.ndarray) and isinstance(b0.labels, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(b0.images[1]), _img(11))


def test_epoch_order_is_the_feeds(tree):
    """ImageFolder's epochs come in the feeds' epoch order (a keyed permutation of (seed,
    epoch), the one Feed cuts into ranks' batches), so every feed shares one order rule."""
    from avpipe.pipeline.feed import EpochOrder, plans

    ds = ImageFolder(tree, batch_size=2, device="cpu", shuffle=True, seed=7)
    paths = [p for p, _ in ds.samples]
    for epoch in range(3):
        want = [paths[i] for i in plans.permutation(len(paths), seed=7, epoch=epoch)]
        assert [p for b in ds for p in b.paths] == want
    assert isinstance(ds.order, EpochOrder)
