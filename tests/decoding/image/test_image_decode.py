"""avpipe.decode_images: formats, pixel conventions, EXIF, ROI, errors; GPU vs CPU."""

from __future__ import annotations

import io

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageOps, features  # noqa: E402

import avpipe  # noqa: E402
from avpipe.decoding.image import (  # noqa: E402
    decode_image_batch,
    decoder_status,
    sniff_format,
)
from avpipe.errors import CorruptDataError, DecodeError, UnsupportedFormatError  # noqa: E402
from avpipe.pipeline.image_stream import decode_image_stream  # noqa: E402

pytest.importorskip("nvidia.dali")

H, W = 45, 62


def _picture(h=H, w=W, seed=0):
    """A smooth colourful picture with some noise (JPEG-friendly, not constant)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack(
        [
            128 + 90 * np.sin(xx / 9 + c) * np.cos(yy / 7 - c) + rng.normal(0, 4, (h, w))
            for c in range(3)
        ],
        -1,
    )
    return np.clip(img, 0, 255).astype(np.uint8)


def _save(img, path, fmt, **kw):
    Image.fromarray(img).save(path, format=fmt, **kw)
    return str(path)


def _pil_ref(path):
    with Image.open(path) as im:
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))


LOSSLESS = [("png", "PNG", {}), ("tif", "TIFF", {}), ("bmp", "BMP", {}), ("ppm", "PPM", {}),
            ("webp", "WEBP", {"lossless": True})]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    img = _picture()
    out = {"img": img}
    for ext, fmt, kw in LOSSLESS:
        if fmt == "WEBP" and not features.check("webp"):
            continue
        out[ext] = _save(img, d / f"a.{ext}", fmt, **kw)
    out["jpg"] = _save(img, d / "a.jpg", "JPEG", quality=92)
    out["jpg444"] = _save(img, d / "a444.jpg", "JPEG", quality=92, subsampling=0)
    if features.check("jpg_2000"):
        out["jp2"] = _save(img, d / "a.jp2", "JPEG2000", irreversible=False)
    return out


@pytest.mark.parametrize("kind", ["png", "tif", "bmp", "ppm", "webp", "jp2"])
def test_lossless_formats_match_pil_exactly(files, kind):
    if kind not in files:
        pytest.skip(f"PIL cannot write {kind} here")
    (out,) = avpipe.decode_images([files[kind]], device="cpu")
    assert isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == (H, W, 3)
    np.testing.assert_array_equal(out, _pil_ref(files[kind]))
    np.testing.assert_array_equal(out, files["img"])


@pytest.mark.parametrize("kind", ["jpg", "jpg444"])
def test_jpeg_within_2_levels_of_pil(files, kind):
    (out,) = avpipe.decode_images([files[kind]], device="cpu")
    ref = _pil_ref(files[kind])
    assert out.shape == ref.shape
    assert np.abs(out.astype(int) - ref).max() <= 2


def test_batch_of_mixed_formats_and_source_kinds(files):
    data = open(files["png"], "rb").read()
    srcs = [files["jpg"], data, io.BytesIO(data), files["tif"]]
    outs = avpipe.decode_images(srcs, device="cpu")
    assert len(outs) == 4
    np.testing.assert_array_equal(outs[1], files["img"])
    np.testing.assert_array_equal(outs[2], files["img"])
    np.testing.assert_array_equal(outs[3], files["img"])
    # a single source gives a list of one
    (one,) = avpipe.decode_images(data, device="cpu")
    np.testing.assert_array_equal(one, files["img"])


def test_large_batch_reuses_pipelines(files):
    from avpipe.decoding.image import _dali as _image_dali

    srcs = [files["png"]] * 300  # > MAX_BATCH: two chunks
    outs = avpipe.decode_images(srcs, device="cpu")
    assert len(outs) == 300
    assert all(np.array_equal(o, files["img"]) for o in outs[::37])
    n = len(_image_dali._CACHE)
    avpipe.decode_images(srcs, device="cpu")
    assert len(_image_dali._CACHE) == n


def test_gray_palette_alpha_expanded(tmp_path):
    img = _picture()
    gray = img[..., 0]
    p_gray = _save(gray, tmp_path / "g.png", "PNG")
    p_grayj = _save(gray, tmp_path / "g.jpg", "JPEG", quality=95)
    p_grayt = _save(gray, tmp_path / "g.tif", "TIFF")
    pal = Image.fromarray(img).convert("P", palette=Image.ADAPTIVE, colors=32)
    pal.save(tmp_path / "p.png")
    rgba = np.concatenate([img, (np.arange(W) * 4 % 256).astype(np.uint8)[None, :, None]
                           .repeat(H, 0)], -1)  # fmt: skip
    p_rgba = _save(rgba, tmp_path / "a.png", "PNG")
    p_rgbat = _save(rgba, tmp_path / "a.tif", "TIFF")
    paths = [p_gray, p_grayt, str(tmp_path / "p.png"), p_rgba, p_rgbat]
    outs = avpipe.decode_images(paths + [p_grayj], device="cpu")
    for p, o in zip(paths, outs):
        assert o.shape == (H, W, 3), p
        np.testing.assert_array_equal(o, _pil_ref(p), err_msg=p)
    np.testing.assert_array_equal(outs[0], np.repeat(gray[..., None], 3, -1))
    np.testing.assert_array_equal(outs[3], img)  # alpha dropped, colour untouched
    assert np.abs(outs[-1].astype(int) - _pil_ref(p_grayj)).max() <= 2


@pytest.mark.parametrize("fmt,ext", [("PNG", "png"), ("TIFF", "tif")])
def test_16_bit_scaled_by_round_x_over_257(tmp_path, fmt, ext):
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 65536, (H, W), dtype=np.uint16)
    raw[0, :6] = [0, 128, 129, 385, 386, 65535]  # rounding boundaries of x / 257
    p = tmp_path / f"g16.{ext}"
    Image.fromarray(raw).save(p, format=fmt)
    (out,) = avpipe.decode_images([str(p)], device="cpu")
    expect = np.floor(raw / 257.0 + 0.5).astype(np.uint8)
    np.testing.assert_array_equal(out, np.repeat(expect[..., None], 3, -1))
    assert out[0, :6, 0].tolist() == [0, 0, 1, 1, 2, 255]


def test_16_bit_rgb_png(tmp_path):
    # 16-bit RGB through PyAV's PNG encoder (PIL cannot write it)
    av = pytest.importorskip("av")
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 65536, (H, W, 3), dtype=np.uint16)
    cc = av.CodecContext.create("png", "w")
    cc.width, cc.height, cc.pix_fmt = W, H, "rgb48be"
    frame = av.VideoFrame.from_ndarray(raw, format="rgb48le").reformat(format="rgb48be")
    data = b"".join(bytes(p) for p in cc.encode(frame) + cc.encode(None))
    (out,) = avpipe.decode_images([data], device="cpu")
    np.testing.assert_array_equal(out, np.floor(raw / 257.0 + 0.5).astype(np.uint8))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_honoured(tmp_path, orientation):
    img = _picture()
    im = Image.fromarray(img)
    ex = im.getexif()
    ex[0x0112] = orientation
    p = tmp_path / f"o{orientation}.jpg"
    im.save(p, exif=ex.tobytes(), quality=95)
    (out,) = avpipe.decode_images([str(p)], device="cpu")
    ref = _pil_ref(p)
    assert out.shape == ref.shape
    assert out.shape[:2] == ((W, H) if orientation in (6, 8) else (H, W))
    assert np.abs(out.astype(int) - ref).max() <= 2


def test_roi_equals_decode_then_crop(files):
    srcs = [files["jpg"], files["png"], files["tif"]] + ([files["jp2"]] if "jp2" in files else [])
    full = avpipe.decode_images(srcs, device="cpu")
    box = (5, 9, 20, 31)
    part = avpipe.decode_images(srcs, device="cpu", roi=[box] * len(srcs))
    for f, p in zip(full, part):
        np.testing.assert_array_equal(p, f[5:25, 9:40])
    # boxes are clipped to the picture; None decodes everything
    clipped = avpipe.decode_images(srcs[:2], device="cpu", roi=[(40, 50, 100, 100), None])
    assert clipped[0].shape == (H - 40, W - 50, 3)
    np.testing.assert_array_equal(clipped[1], full[1])


def test_sniff_format():
    assert sniff_format(b"\xff\xd8\xff\xe0") == "jpeg"
    assert sniff_format(b"\x89PNG\r\n\x1a\nxxxx") == "png"
    assert sniff_format(b"II*\x00") == "tiff"
    assert sniff_format(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "webp"
    assert sniff_format(b"P6\n3 2") == "pnm"
    assert sniff_format(b"GIF89a") is None


# --- bad input ---------------------------------------------------------------------------------


def test_missing_path_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        avpipe.decode_images([str(tmp_path / "nope.jpg")], device="cpu")


@pytest.mark.parametrize("kind", ["jpg", "png", "tif", "jp2"])
def test_truncated_file_is_corrupt_and_named(files, tmp_path, kind):
    if kind not in files:
        pytest.skip(f"no {kind}")
    data = open(files[kind], "rb").read()
    p = tmp_path / f"trunc.{kind}"
    p.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CorruptDataError) as ei:
        avpipe.decode_images([str(p)], device="cpu")
    assert ei.value.source == str(p) and str(p) in str(ei.value)


def test_garbage_and_empty(tmp_path):
    g = tmp_path / "g.jpg"
    g.write_bytes(b"this is not an image at all" * 4)
    e = tmp_path / "e.png"
    e.write_bytes(b"")
    with pytest.raises(UnsupportedFormatError) as ei:
        avpipe.decode_images([str(g)], device="cpu")
    assert ei.value.source == str(g)
    with pytest.raises(CorruptDataError) as ei:
        avpipe.decode_images([str(e)], device="cpu")
    assert ei.value.source == str(e)
    with pytest.raises(DecodeError) as ei:
        avpipe.decode_images([b"\x89PNG\r\n\x1a\n broken"], device="cpu")
    assert ei.value.source == "<bytes>"


def test_one_bad_file_does_not_kill_the_batch(files, tmp_path):
    data = open(files["jpg"], "rb").read()
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(data[: len(data) // 2])
    srcs = [files["png"], str(bad), files["tif"], b"", files["png"]]
    res = decode_image_batch(srcs, device="cpu")
    assert [i for i, _ in res.errors] == [1, 3]
    assert res.errors[0][1].source == str(bad)
    assert res.images[1] is None and res.images[3] is None
    for i in (0, 2, 4):
        np.testing.assert_array_equal(res.images[i], files["img"])
    skipped = avpipe.decode_images(srcs, device="cpu", on_error="skip")
    assert skipped[1] is None and skipped[0] is not None
    with pytest.raises(CorruptDataError):
        avpipe.decode_images(srcs, device="cpu")
    # the pipeline cache recovers after a failure
    (ok,) = avpipe.decode_images([files["png"]], device="cpu")
    np.testing.assert_array_equal(ok, files["img"])


def test_argument_validation(files):
    with pytest.raises(ValueError, match="on_error"):
        avpipe.decode_images([files["png"]], device="cpu", on_error="ignore")
    with pytest.raises(ValueError, match="roi"):
        avpipe.decode_images([files["png"]], device="cpu", roi=[(0, 0, 1, 1)] * 2)
    with pytest.raises(TypeError, match="sources"):
        avpipe.decode_images([123], device="cpu")


def test_decoder_status_reports_cpu_ok():
    st = decoder_status()
    assert st["cpu"] == "ok"
    assert isinstance(st["mixed"], str) and st["mixed"]


# --- GPU ---------------------------------------------------------------------------------------

GPU_JPEG_TOL = 4  # nvJPEG vs libjpeg-turbo, max abs difference (IDCT rounding)


@pytest.mark.gpu
def test_gpu_decodes_match_cpu(files, tmp_path):
    import cupy

    kinds = [k for k in ("jpg", "jpg444", "png", "tif", "jp2", "bmp", "webp", "ppm") if k in files]
    cpu = avpipe.decode_images([files[k] for k in kinds], device="cpu")
    gpu = avpipe.decode_images([files[k] for k in kinds], device="cuda")
    for k, c, g in zip(kinds, cpu, gpu):
        assert isinstance(g, cupy.ndarray) and g.dtype == cupy.uint8 and g.shape == c.shape, k
        diff = np.abs(cupy.asnumpy(g).astype(int) - c)
        # nvJPEG's IDCT rounds differently from libjpeg-turbo's: up to 4 levels, rarely
        assert diff.max() <= (GPU_JPEG_TOL if k.startswith("jpg") else 0), (k, diff.max())
        assert diff.mean() <= 1.0, (k, diff.mean())  # 0.69 measured on a 62x45 JPEG


@pytest.mark.gpu
def test_gpu_default_device_and_status():
    import cupy

    (img,) = avpipe.decode_images([_png_bytes(_picture())])
    assert isinstance(img, cupy.ndarray)
    assert decoder_status()["mixed"] == "ok"


def _png_bytes(img):
    b = io.BytesIO()
    Image.fromarray(img).save(b, format="PNG")
    return b.getvalue()


@pytest.mark.gpu
def test_gpu_16_bit_exif_gray_roi(tmp_path):
    import cupy

    raw = np.random.default_rng(5).integers(0, 65536, (H, W), dtype=np.uint16)
    p16 = tmp_path / "g16.png"
    Image.fromarray(raw).save(p16)
    im = Image.fromarray(_picture())
    ex = im.getexif()
    ex[0x0112] = 6
    pex = tmp_path / "ex.jpg"
    im.save(pex, exif=ex.tobytes(), quality=95)
    pg = tmp_path / "g.jpg"
    Image.fromarray(_picture()[..., 1]).save(pg, quality=95)
    srcs = [str(p16), str(pex), str(pg)]
    cpu = avpipe.decode_images(srcs, device="cpu")
    gpu = [cupy.asnumpy(g) for g in avpipe.decode_images(srcs, device="cuda")]
    for c, g in zip(cpu, gpu):
        assert c.shape == g.shape
        assert np.abs(c.astype(int) - g).max() <= GPU_JPEG_TOL
    roi = [(3, 4, 20, 30)] * 3
    groi = [cupy.asnumpy(g) for g in avpipe.decode_images(srcs, device="cuda", roi=roi)]
    for c, g in zip(cpu, groi):
        assert np.abs(c[3:23, 4:34].astype(int) - g).max() <= GPU_JPEG_TOL


@pytest.mark.gpu
def test_gpu_bad_file_is_typed_and_batch_survives(files, tmp_path):
    data = open(files["jpg"], "rb").read()
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(data[: len(data) // 2])
    res = decode_image_batch([files["jpg"], str(bad), files["png"]], device="cuda")
    assert [i for i, _ in res.errors] == [1]
    assert isinstance(res.errors[0][1], DecodeError) and res.errors[0][1].source == str(bad)
    assert res.images[0] is not None and res.images[2] is not None


def _png_with_bad_idat(path, out):
    """A PNG whose header parses but whose pixel data (IDAT) is garbage with a wrong CRC: it
    reaches the decoder and fails there."""
    data = bytearray(open(path, "rb").read())
    at = data.index(b"IDAT")
    n = int.from_bytes(data[at - 4 : at], "big")
    data[at + 4 : at + 4 + n] = np.random.default_rng(3).integers(0, 256, n, np.uint8).tobytes()
    out.write_bytes(bytes(data))
    return str(out)


def test_png_with_bad_idat_fails_on_the_cpu(files, tmp_path):
    bad = _png_with_bad_idat(files["png"], tmp_path / "idat.png")
    res = decode_image_batch([files["png"], bad, files["png"]], device="cpu")
    assert [i for i, _ in res.errors] == [1]
    assert isinstance(res.errors[0][1], CorruptDataError) and "PNG" in str(res.errors[0][1])


@pytest.mark.gpu
def test_gpu_bad_images_keep_the_decoder(files, tmp_path, capfd):
    """A bad image on the GPU costs one failed decode: the decoder is kept (not rebuilt), the
    images around it decode as the CPU decodes them, and the error is a sentence naming the
    file, with the decoder's own lines in it instead of on stderr."""
    import cupy

    from avpipe.decoding.image import _nvimgcodec

    bad = _png_with_bad_idat(files["png"], tmp_path / "idat.png")
    junk = tmp_path / "junk.png"  # a PNG signature, then nothing that parses
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40 + b"IEND")
    srcs = [files["jpg"], bad, files["png"], str(junk), files["tif"]]
    ref = avpipe.decode_images(srcs, device="cpu", on_error="skip")
    decode_image_batch([files["jpg"]], device="cuda")
    decoders = list(_nvimgcodec._CACHE.values())
    capfd.readouterr()
    for _ in range(3):
        res = decode_image_batch(srcs, device="cuda")
        assert [i for i, _ in res.errors] == [1, 3]
        for i, e in res.errors:
            assert isinstance(e, CorruptDataError) and e.source == srcs[i] and "PNG" in str(e)
        for k in (0, 2, 4):
            got = cupy.asnumpy(res.images[k])
            assert np.abs(got.astype(int) - ref[k]).max() <= GPU_JPEG_TOL
    assert list(_nvimgcodec._CACHE.values()) == decoders  # nothing was rebuilt
    assert "png" not in capfd.readouterr().err.lower()


@pytest.mark.gpu
@pytest.mark.parametrize("load", ["0", "0.5", "1"])
def test_gpu_jpeg_hardware_share_matches_cpu(tmp_path, monkeypatch, load):
    """AVPIPE_JPEG_HW_LOAD splits a batch between the hardware and CUDA JPEG decoders: every
    split gives the CPU's pixels within tolerance, in the batch and the stream."""
    import cupy

    from avpipe.pipeline.image_stream import decode_image_stream

    monkeypatch.setenv("AVPIPE_JPEG_HW_LOAD", load)
    paths = []
    for i in range(8):
        p = tmp_path / f"{i}.jpg"
        Image.fromarray(np.roll(_picture(), 7 * i, axis=1)).save(p, quality=90)
        paths.append(str(p))
    cpu = avpipe.decode_images(paths, device="cpu")
    gpu = [cupy.asnumpy(g) for g in avpipe.decode_images(paths, device="cuda")]
    streamed = []
    for b in decode_image_stream(paths, batch_size=8, device="cuda"):
        streamed += [cupy.asnumpy(im) for im in b.images]
    assert len(gpu) == len(streamed) == 8
    for c, g, s in zip(cpu, gpu, streamed):
        assert np.abs(c.astype(int) - g).max() <= GPU_JPEG_TOL
        assert np.abs(c.astype(int) - s).max() <= GPU_JPEG_TOL


@pytest.mark.gpu
def test_gpu_bad_hardware_share_is_the_callers_error(files, monkeypatch):
    from avpipe.pipeline.image_stream import decode_image_stream

    monkeypatch.setenv("AVPIPE_JPEG_HW_LOAD", "2")
    with pytest.raises(ValueError, match="AVPIPE_JPEG_HW_LOAD"):
        decode_image_batch([files["jpg"]], device="cuda")
    with pytest.raises(ValueError, match="AVPIPE_JPEG_HW_LOAD"):
        decode_image_stream([files["jpg"]], device="cuda")


# --- streaming (prefetching) decode -------------------------------------------------------------


def test_stream_batches_equal_batch_decode(files):
    from avpipe.pipeline.image_stream import decode_image_stream

    srcs = [files["png"], files["jpg"], files["tif"]] * 3  # 9 images, batches of 4, 4, 1
    ref = avpipe.decode_images(srcs, device="cpu")
    got, sizes = [], []
    for b in decode_image_stream(srcs, batch_size=4, device="cpu"):
        assert b.errors == ()
        sizes.append(len(b.images))
        if b.stacked is not None:
            assert b.stacked.shape == (len(b.images), H, W, 3)
        got += [im.copy() for im in b.images]
    assert sizes == [4, 4, 1]
    for r, g in zip(ref, got):
        np.testing.assert_array_equal(r, g)
    with pytest.raises(ValueError, match="batch_size"):
        next(decode_image_stream(srcs, batch_size=0, device="cpu"))
    with pytest.raises(FileNotFoundError):
        decode_image_stream(["/no/such/file.png"], device="cpu")


def test_stream_bad_image_reported_and_rest_decoded(files):
    from avpipe.pipeline.image_stream import decode_image_stream

    data = open(files["jpg"], "rb").read()
    srcs = [files["png"], files["png"], data[:300], files["png"], b"junk", files["png"]]
    batches = list(decode_image_stream(srcs, batch_size=2, device="cpu"))
    assert [len(b.images) for b in batches] == [2, 2, 2]
    assert [(i, type(e)) for i, e in batches[1].errors] == [(0, CorruptDataError)]
    assert [(i, type(e)) for i, e in batches[2].errors] == [(0, UnsupportedFormatError)]
    assert batches[1].images[1] is not None and batches[2].images[1] is not None
    np.testing.assert_array_equal(batches[2].images[1], files["img"])


def test_stream_of_paths_with_a_bad_file(files, tmp_path):
    # all paths: DALI's own file reader feeds the decoder; a bad file still comes back typed
    from avpipe.pipeline.image_stream import decode_image_stream

    data = open(files["jpg"], "rb").read()
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(data[: len(data) // 3])
    srcs = [files["png"]] * 3 + [str(bad)] + [files["tif"]] * 3
    batches = list(decode_image_stream(srcs, batch_size=3, device="cpu"))
    assert [len(b.images) for b in batches] == [3, 3, 1]
    assert batches[0].stacked.shape == (3, H, W, 3)
    assert [(i, e.source) for i, e in batches[1].errors] == [(0, str(bad))]
    np.testing.assert_array_equal(batches[1].images[2], files["img"])
    np.testing.assert_array_equal(batches[2].images[0], files["img"])


def test_stream_goes_back_to_prefetching_after_a_bad_image(files, tmp_path, monkeypatch):
    """A failed batch is decoded by the per-batch path and the prefetching path starts again
    after it; the r-th failure keeps 2**(r-1) - 1 more batches on the per-batch path."""
    from avpipe.pipeline import image_stream as S

    data = open(files["jpg"], "rb").read()
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(data[: len(data) // 3])
    png, tif, b = files["png"], files["tif"], str(bad)
    srcs = [png] * 3 + [b, tif, tif] + [tif, png, png] + [png, b, png] + [png] * 6
    slow, fast = [], []
    real_batch, real_fast = S.decode_image_batch, S._fast_run

    def spy_batch(chunk, **kw):
        slow.append([srcs_index[id(s)] for s in chunk])
        return real_batch(chunk, **kw)

    def spy_fast(chunks, *a):
        fast.append(len(chunks))
        return real_fast(chunks, *a)

    monkeypatch.setattr(S, "decode_image_batch", spy_batch)
    monkeypatch.setattr(S, "_fast_run", spy_fast)
    srcs_index = {}
    orig_open = S.open_source

    def spy_open(s, param=None):
        src = orig_open(s, param=param)
        srcs_index[id(src)] = int(param.split("[")[1].rstrip("]"))
        return src

    monkeypatch.setattr(S, "open_source", spy_open)
    batches = list(S.decode_image_stream(srcs, batch_size=3, device="cpu"))
    assert [len(x.images) for x in batches] == [3] * 6
    assert slow == [[3, 4, 5], [9, 10, 11], [12, 13, 14]]  # chunks 1, 3 and (pause) 4
    assert fast == [6, 4, 1]  # from chunks 0, 2 and 5
    assert [(i, e.source) for i, e in batches[1].errors] == [(0, b)]
    assert [(i, e.source) for i, e in batches[3].errors] == [(1, b)]
    for k, x in enumerate(batches):
        for j, im in enumerate(x.images):
            if srcs[3 * k + j] != b:
                np.testing.assert_array_equal(im, files["img"])


@pytest.mark.gpu
def test_gpu_stream_matches_cpu(files):
    import cupy

    from avpipe.pipeline.image_stream import decode_image_stream

    srcs = [files["png"], files["tif"], files["jpg444"]] * 3
    ref = avpipe.decode_images(srcs, device="cpu")
    got = []
    for b in decode_image_stream(srcs, batch_size=4, device="cuda"):
        assert all(isinstance(im, cupy.ndarray) for im in b.images)
        got += [cupy.asnumpy(im) for im in b.images]
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        assert np.abs(r.astype(int) - g).max() <= 2


# --- decode-time centre-square crop -------------------------------------------------------------


def _square_cases(tmp_path, sizes=((37, 50), (50, 37), (30, 30), (11, 23))):
    out = []
    for i, (h, w) in enumerate(sizes):
        a = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        p = tmp_path / f"sq{i}_{h}x{w}.png"
        Image.fromarray(a).save(p)
        out.append((str(p), a))
    return out


def _square_check(cases, device, margin, bad=None):
    """Every crop is ``square_window``'s part of the image, and ``windows`` say where it lies."""
    from avpipe.decoding.image import square_window
    from avpipe.device import to_numpy

    paths = [p for p, _ in cases]
    if bad is not None:
        paths.insert(1, bad)
    got, windows, errors = [], [], []
    for b in decode_image_stream(paths, batch_size=3, device=device, center_square=True,
                                 center_square_margin=margin):  # fmt: skip
        got += [None if im is None else to_numpy(im).copy() for im in b.images]
        windows += list(b.windows)
        errors += [len(got) - len(b.images) + i for i, _ in b.errors]
    if bad is not None:
        assert errors == [1] and got[1] is None and windows[1] is None
        del got[1], windows[1]
    assert len(got) == len(windows) == len(cases)
    for g, win, (_, a) in zip(got, windows, cases):
        h, w = a.shape[:2]
        top, left, ch, cw = square_window(h, w, margin)
        assert win == (top, left, h, w)
        np.testing.assert_array_equal(g, a[top : top + ch, left : left + cw])
    return got, windows


def test_stream_center_square_is_the_middle_square_plus_margin(tmp_path):
    cases = _square_cases(tmp_path)
    got, _ = _square_check(cases, "cpu", 0.0)  # the bare square
    assert [g.shape[:2] for g in got] == [(37, 37), (37, 37), (30, 30), (11, 11)]
    big = _square_cases(tmp_path, ((120, 160), (161, 100), (64, 64)))
    got, _ = _square_check(big, "cpu", 0.02)  # + ceil(0.02 * side) + 3 a side where there is room
    assert [g.shape[:2] for g in got] == [(120, 120 + 2 * 6), (100 + 2 * 5, 100), (64, 64)]
    _square_check(big, "cpu", 0.1)
    # 100 * 0.15 is 15.0 in float64 but just over 15 in float32 (DALI's graph arithmetic): the
    # fast path's windows and square_window (the slow path's) must still agree
    _square_check(_square_cases(tmp_path, ((100, 160),)), "cpu", 0.15)
    with pytest.raises(TypeError, match="center_square must be a bool"):
        decode_image_stream([], center_square="yes")
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="center_square_margin"):
            decode_image_stream([], center_square=True, center_square_margin=bad)


def test_stream_center_square_with_a_bad_file_keeps_windows(tmp_path):
    """The slow path (a batch with a bad image is decoded again) crops the same way."""
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    _square_check(_square_cases(tmp_path, ((120, 160), (161, 100), (64, 64))), "cpu", 0.02,
                  bad=str(bad))  # fmt: skip


def test_stream_crops_resize_like_the_whole_images(tmp_path):
    """decode-time crop + resize_crop_normalize(window=) == whole decode + resize_crop_normalize."""
    from avpipe.ops.image import resize_crop_normalize

    cases = _square_cases(tmp_path, ((120, 160), (120, 160), (160, 120)))
    paths = [p for p, _ in cases]
    for interp in ("bilinear", "bicubic"):  # crop == short side: the filter reaches the margin
        opts = dict(short_side=64, crop_size=64, interpolation=interp, dtype="float32")
        streamed = []
        for b in decode_image_stream(paths, batch_size=2, device="cpu", center_square=True):
            for im, win in zip(b.images, b.windows):
                assert im.shape[:2] != (win[2], win[3])  # decoded less than the image
                streamed.append(resize_crop_normalize(im, window=win, **opts))
        for got, (_, a) in zip(streamed, cases):
            np.testing.assert_allclose(got, resize_crop_normalize(a, **opts), atol=1e-5)
    # a target too small for the default margin (bicubic reaches 2 * 120 / 32 = 7.5 pixels)
    (b,) = decode_image_stream(paths[:1], device="cpu", center_square=True)
    with pytest.raises(ValueError, match="does not hold"):
        resize_crop_normalize(b.images[0], short_side=32, crop_size=32, interpolation="bicubic",
                              window=b.windows[0])  # fmt: skip


@pytest.mark.gpu
def test_gpu_stream_center_square(tmp_path):
    import cupy

    from avpipe.ops.image import resize_crop_normalize

    _square_check(_square_cases(tmp_path), "cuda", 0.0)
    big = _square_cases(tmp_path, ((120, 160), (120, 160), (161, 100)))
    _square_check(big, "cuda", 0.02)
    # a stacked batch of crops with one window: one call equals the whole images' result
    opts = dict(short_side=64, crop_size=56, dtype="float32")
    for b in decode_image_stream([p for p, _ in big[:2]], batch_size=2, device="cuda",
                                 center_square=True):  # fmt: skip
        assert b.stacked is not None and b.windows[0] == b.windows[1]
        got = cupy.asnumpy(resize_crop_normalize(b.stacked, window=b.windows[0], **opts))
        want = resize_crop_normalize(np.stack([a for _, a in big[:2]]), **opts)
        np.testing.assert_allclose(got, want, atol=1e-3)
