"""Hostile images: JPEG 2000 headers that kill decoders (a tile size of 0: SIGFPE), headers no
check can vouch for (decoded in a helper process), and decompression bombs (the pixel cap).

Every public image API runs in a subprocess over the hostile files between good ones: the
process must survive, and each hostile file must come back as a typed error naming it."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from paths import REPO, TESTS

ROOT = REPO
SAMPLES = os.path.join(ROOT, "samples", "images")


def _j2k(raw: bool) -> bytes:
    """A clean 56x40 JPEG 2000: a raw codestream (``.j2k``) or the JP2 box wrapper."""
    from PIL import Image, features

    if not features.check("jpg_2000"):
        pytest.skip("Pillow without OpenJPEG")
    a = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG2000", no_jp2=raw)
    return buf.getvalue()


# SIZ fields after the marker: Lsiz Rsiz Xsiz Ysiz XOsiz YOsiz XTsiz YTsiz XTOsiz YTOsiz Csiz
_SIZ = {"Xsiz": 6, "Ysiz": 10, "XOsiz": 14, "YOsiz": 18, "XTsiz": 22, "YTsiz": 26,
        "XTOsiz": 30, "YTOsiz": 34}  # fmt: skip


def patch_siz(data: bytes, **fields) -> bytes:
    """``data`` with SIZ fields set (offsets from the SIZ marker); ``Ssiz0``/``XRsiz0`` set the
    first component's precision byte / horizontal subsampling."""
    b = bytearray(data)
    s = b.find(b"\xff\x51")
    for k, v in fields.items():
        if k == "Ssiz0":
            b[s + 40] = v
        elif k == "XRsiz0":
            b[s + 41] = v
        else:
            struct.pack_into(">I", b, s + _SIZ[k], v)
    return bytes(b)


def hide_header(jp2: bytes) -> bytes:
    """A JP2 whose codestream begins past the first 64 KiB (an ``xml`` box before it): the
    header check cannot read it, so it cannot vouch for the file."""
    i = jp2.find(b"jp2c") - 4
    xml = b"<a>" + b"x" * 70000 + b"</a>"
    return jp2[:i] + struct.pack(">I", len(xml) + 8) + b"xml " + xml + jp2[i:]


def png_bomb(w: int, h: int) -> bytes:
    """A gray PNG of ``w`` x ``h`` zeros: under a megabyte that decodes to ``w * h`` bytes."""
    comp = zlib.compressobj(9)
    rows = (b"\x00" + bytes(w)) * 500
    body = b"".join(comp.compress(rows) for _ in range(h // 500)) + comp.flush()

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body)
            + chunk(b"IEND", b""))  # fmt: skip


def jpeg_claiming(w: int, h: int) -> bytes:
    """The sample JPEG with its frame header claiming ``w`` x ``h``."""
    with open(os.path.join(SAMPLES, "scene.jpg"), "rb") as f:
        b = bytearray(f.read())
    s = b.find(b"\xff\xc0")
    struct.pack_into(">HH", b, s + 5, h, w)
    return bytes(b)


HOSTILE_J2K = {  # name -> SIZ patch: each a header no decoder may be handed
    "tile_w0": dict(XTsiz=0),
    "tile_h0": dict(YTsiz=0),
    "tile_00": dict(XTsiz=0, YTsiz=0),
    "tiles_too_many": dict(Xsiz=1 << 20, Ysiz=1 << 20, XTsiz=1, YTsiz=1),
    "tile_past_canvas": dict(XTOsiz=0xFFFFFFF0, XTsiz=0xFFFFFFF0),
    "image_w0": dict(Xsiz=0),
    "offset_past_size": dict(XOsiz=1000),
    "subsampling0": dict(XRsiz0=0),
    "precision_128": dict(Ssiz0=0x7F),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """``(good paths, {hostile path: what})`` in one folder."""
    d = tmp_path_factory.mktemp("hostile")
    bad = {}
    for raw, ext in ((True, ".j2k"), (False, ".jp2")):
        clean = _j2k(raw)
        for name, fields in HOSTILE_J2K.items():
            p = d / f"{name}{ext}"
            p.write_bytes(patch_siz(clean, **fields))
            bad[str(p)] = "CorruptDataError"
    p = d / "hidden_tile0.jp2"
    p.write_bytes(hide_header(patch_siz(_j2k(False), XTsiz=0)))
    bad[str(p)] = "CorruptDataError"
    p = d / "bomb.png"
    p.write_bytes(png_bomb(30000, 30000))
    bad[str(p)] = "ImageTooLargeError"
    p = d / "bomb.jpg"
    p.write_bytes(jpeg_claiming(65000, 65000))
    bad[str(p)] = "ImageTooLargeError"
    goods = [os.path.join(SAMPLES, n) for n in ("scene.jpg", "scene.png", "scene.jp2")]
    return goods, bad


_RUN = r"""
import json, sys
api, goods, bad = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
import avpipe
paths = []
for b in bad:
    paths += [b, goods[len(paths) % len(goods)]]
out = {}
if api == "batch":
    from avpipe.decoding.image import decode_image_batch
    r = decode_image_batch(paths, device="cpu")
    out = {paths[i]: [type(e).__name__, str(e)] for i, e in r.errors}
    ok = [i for i, im in enumerate(r.images) if im is not None]
elif api == "images":
    from avpipe.decoding.image import decode_images
    ok = []
    for i, p in enumerate(paths):
        try:
            decode_images([p], device="cpu")
            ok.append(i)
        except avpipe.DecodeError as e:
            out[p] = [type(e).__name__, str(e)]
elif api == "stream":
    from avpipe.pipeline.image_stream import decode_image_stream
    ok, k = [], 0
    for b in decode_image_stream(paths, batch_size=3, device="cpu"):
        out.update({paths[k + i]: [type(e).__name__, str(e)] for i, e in b.errors})
        ok += [k + i for i, im in enumerate(b.images) if im is not None]
        k += len(b.images)
elif api == "folder":
    import os, shutil, tempfile
    from avpipe.pipeline.image_folder import ImageFolder
    root = tempfile.mkdtemp()
    os.makedirs(os.path.join(root, "c"))
    for i, p in enumerate(paths):
        shutil.copy(p, os.path.join(root, "c", f"{i:03d}_" + os.path.basename(p)))
    f = ImageFolder(root, batch_size=4, device="cpu")
    n = sum(len(b.paths) for b in f)
    names = {os.path.join(root, "c", f"{i:03d}_" + os.path.basename(p)): p
             for i, p in enumerate(paths)}
    out = {names[p]: [type(e).__name__, str(e).replace(p, names[p])] for p, e in f.errors}
    ok = list(range(n))
elif api == "classification":
    from avpipe.recipes import image_classification
    feed = image_classification([(p, "x") for p in paths], crop_size=16, resize_size=20,
                                batch_size=4, train=False, device="cpu")
    n = sum(len(b.paths) for b in feed)
    out = {p: [msg.split(":")[0], msg] for p, msg in feed.errors}
    ok = list(range(n))
print(json.dumps({"errors": out, "ok": len(ok)}))
"""


@pytest.mark.parametrize("api", ["batch", "images", "stream", "folder", "classification"])
def test_hostile_images_cost_only_themselves(hostile, api):
    goods, bad = hostile
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _RUN, api, json.dumps(goods), json.dumps(list(bad))],
                       capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, f"the process died (exit {r.returncode}): {r.stderr[-2000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["ok"] == len(bad), res  # every good file between them decoded
    assert set(res["errors"]) == set(bad), sorted(set(bad) ^ set(res["errors"]))
    for p, (typ, msg) in res["errors"].items():
        assert typ == bad[p], (p, typ, msg)
        assert p in msg, msg
        if typ == "ImageTooLargeError":
            assert "max_pixels" in msg and "x" in msg
    hidden = next(p for p in bad if p.endswith("hidden_tile0.jp2"))
    assert "crashed" in res["errors"][hidden][1] and "SIGFPE" in res["errors"][hidden][1]


# --- the header check itself -----------------------------------------------------------------


@pytest.mark.parametrize("raw", [True, False], ids=["j2k", "jp2"])
@pytest.mark.parametrize("name", sorted(HOSTILE_J2K))
def test_j2k_header_check_refuses_invalid_siz(raw, name):
    from avpipe.decoding.image import j2k_header_problem
    from avpipe.decoding.image._header import j2k_check

    clean = _j2k(raw)
    assert j2k_check(clean) == (None, True)
    why = j2k_header_problem(patch_siz(clean, **HOSTILE_J2K[name]))
    assert why is not None and "SIZ" in why, why


@pytest.mark.parametrize("fields", [dict(XTsiz=0xFFFFFFFF, YTsiz=0xFFFFFFFF), dict(XTsiz=1, YTsiz=1)],
                         ids=["one_huge_tile", "tiny_tiles"])  # fmt: skip
def test_j2k_valid_tilings_still_decode(fields):
    """A tile larger than the image and 1x1 tiles (2240 of them) are valid: they decode."""
    from avpipe.decoding.image import decode_image_batch

    data = patch_siz(_j2k(True), **fields)
    r = decode_image_batch([data], device="cpu")
    assert not r.errors and r.images[0].shape == (40, 56, 3)


def test_hidden_header_is_not_vouched_for():
    from avpipe.decoding.image._header import j2k_check

    assert j2k_check(hide_header(_j2k(False))) == (None, False)


def test_hidden_header_good_file_decodes_in_the_helper():
    """An unverifiable but good JPEG 2000 decodes (in the helper), with the same pixels."""
    from avpipe.decoding.image import decode_image_batch

    clean = _j2k(False)
    r = decode_image_batch([clean, hide_header(clean)], device="cpu")
    assert not r.errors
    np.testing.assert_array_equal(r.images[0], r.images[1])


# --- the pixel cap ---------------------------------------------------------------------------


def test_pixel_cap_option_and_setting(monkeypatch, tmp_path):
    from avpipe.decoding.image import decode_image_batch
    from avpipe.errors import ImageTooLargeError

    jpg = os.path.join(SAMPLES, "scene.jpg")  # 320x240 = 76,800 pixels
    r = decode_image_batch([jpg], device="cpu", max_pixels=76_799)
    assert isinstance(r.errors[0][1], ImageTooLargeError)
    assert "320x240" in str(r.errors[0][1]) and jpg in str(r.errors[0][1])
    assert not decode_image_batch([jpg], device="cpu", max_pixels=76_800).errors
    monkeypatch.setenv("AVPIPE_MAX_IMAGE_PIXELS", "1000")
    assert isinstance(decode_image_batch([jpg], device="cpu").errors[0][1], ImageTooLargeError)
    assert not decode_image_batch([jpg], device="cpu", max_pixels=0).errors  # 0: no cap
    monkeypatch.setenv("AVPIPE_MAX_IMAGE_PIXELS", "0")
    assert not decode_image_batch([jpg], device="cpu").errors
    with pytest.raises(ValueError, match="max_pixels.*-1"):
        decode_image_batch([jpg], device="cpu", max_pixels=-1)
    with pytest.raises(TypeError, match="max_pixels"):
        decode_image_batch([jpg], device="cpu", max_pixels=1.5)


def test_default_cap_refuses_a_png_bomb(tmp_path):
    from avpipe.decoding.image import decode_image_batch
    from avpipe.errors import ImageTooLargeError

    p = tmp_path / "bomb.png"
    p.write_bytes(png_bomb(30000, 30000))
    assert p.stat().st_size < 1_000_000
    r = decode_image_batch([str(p)], device="cpu")
    e = r.errors[0][1]
    assert isinstance(e, ImageTooLargeError) and "30000x30000" in str(e) and str(p) in str(e)


def test_image_sizes_from_headers(tmp_path):
    """The header reader's sizes agree with the decoded images for every sample format."""
    from PIL import Image

    from avpipe.decoding.image import sniff_format
    from avpipe.decoding.image._header import bytes_reader, image_size

    a = np.zeros((37, 53, 3), np.uint8)
    files = {}
    for fmt, kw in (("BMP", {}), ("WEBP", {"lossless": True}), ("WEBP", {"quality": 50}),
                    ("PPM", {}), ("TIFF", {}), ("PNG", {}), ("JPEG", {})):  # fmt: skip
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, fmt, **kw)
        files[f"{fmt}{kw}"] = buf.getvalue()
    for name in os.listdir(SAMPLES):
        with open(os.path.join(SAMPLES, name), "rb") as f:
            files[name] = f.read()
    for name, data in files.items():
        want = Image.open(io.BytesIO(data)).size[::-1]
        assert image_size(bytes_reader(data), sniff_format(data)) == want, name


# --- the stream reads headers ahead, on a thread -----------------------------------------------


@pytest.mark.parametrize("ahead", [2, 64])
def test_stream_reads_headers_ahead(monkeypatch, tmp_path, ahead):
    """Long streams read their headers on a thread while decoding (runs of ``RUN_AHEAD``
    chunks): every good image decodes, in order, and each refused one is reported at its
    place, also past the first run."""
    from avpipe.errors import CorruptDataError, ImageTooLargeError
    from avpipe.pipeline import image_stream

    monkeypatch.setattr(image_stream, "RUN_AHEAD", ahead)
    jpg = os.path.join(SAMPLES, "scene.jpg")
    bomb = tmp_path / "bomb.jpg"
    bomb.write_bytes(jpeg_claiming(60000, 60000))
    tile0 = tmp_path / "tile0.j2k"
    tile0.write_bytes(patch_siz(_j2k(True), XTsiz=0))
    paths = [jpg] * 140
    paths[3], paths[100], paths[137] = str(bomb), str(tile0), str(bomb)
    got, errors = [], {}
    for b in image_stream.decode_image_stream(paths, batch_size=2, device="cpu"):
        errors.update({len(got) + i: e for i, e in b.errors})
        got += [None if im is None else im.shape for im in b.images]
    assert len(got) == 140
    assert {i: type(e) for i, e in errors.items()} == {
        3: ImageTooLargeError, 100: CorruptDataError, 137: ImageTooLargeError}
    assert all(got[i] == (240, 320, 3) for i in range(140) if i not in errors)


def test_isolation_all_decodes_every_image_in_the_helper(monkeypatch):
    """``AVPIPE_IMAGE_ISOLATION=all``: the same pixels, from the helper process."""
    from avpipe.decoding.image import _isolated, decode_image_batch

    paths = [os.path.join(SAMPLES, n) for n in ("scene.jpg", "scene.png", "scene.tif")]
    want = decode_image_batch(paths, device="cpu").images
    calls = []
    real = _isolated.decode
    monkeypatch.setattr(_isolated, "decode", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    monkeypatch.setenv("AVPIPE_IMAGE_ISOLATION", "all")
    got = decode_image_batch(paths, device="cpu", roi=[None, (10, 20, 30, 40), None]).images
    assert calls == paths
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1][10:40, 20:60])
    np.testing.assert_array_equal(got[2], want[2])
    monkeypatch.setenv("AVPIPE_IMAGE_ISOLATION", "sometimes")
    with pytest.raises(ValueError, match="AVPIPE_IMAGE_ISOLATION.*sometimes"):
        decode_image_batch(paths, device="cpu")


# --- the fuzz corpus's hostile kinds and the harness's rule for them ----------------------------


def test_fuzz_corpus_hostile_kinds_are_refused_cases(tmp_path):
    sys.path.insert(0, TESTS)
    from fuzz import corpus, harness

    from avpipe.decoding.image import j2k_header_problem, sniff_format
    from avpipe.decoding.image._header import bytes_reader, image_size

    cases = corpus.generate(tmp_path, per_format=20, seed=0,
                            families=["jp2", "png", "jpeg", "tiff"])  # fmt: skip
    by = {(c["family"], c["damage"]): c for c in cases}
    tz = by["jp2", "tile_zero"]
    assert tz["expect"] == "refused:CorruptDataError"
    data = open(tz["path"], "rb").read()
    assert "tile size" in j2k_header_problem(data)
    for fam in ("jp2", "png", "jpeg", "tiff"):
        c = by[fam, "bomb"]
        assert c["expect"] == "refused:ImageTooLargeError"
        data = open(c["path"], "rb").read()
        h, w = image_size(bytes_reader(data), sniff_format(data))
        assert h * w > 178_956_970, (fam, h, w)
    assert os.path.getsize(by["png", "bomb"]["path"]) < 1_000_000
    # the harness: a refused case that decodes, or fails with another class, is a failure
    rule = harness.refusal_rule
    assert rule(tz, "decoded", "")[0] == "not_refused"
    assert rule(tz, "typed_error", "ImageTooLargeError: x")[0] == "not_refused"
    assert rule(tz, "skipped", "CorruptDataError: x") == ("skipped", None)
    assert rule(tz, "crash", "") == ("crash", None)
    assert "not_refused" in harness.FAILING
    assert rule({"expect": "any"}, "decoded", "") == ("decoded", None)


def test_fuzz_extract_counts_failed_index_rows_as_errors(tmp_path):
    """``avpipe extract``'s index lists failed items too: the harness reads them as errors."""
    sys.path.insert(0, TESTS)
    from fuzz import harness

    with open(os.path.join(SAMPLES, "scene.png"), "rb") as f:
        png = f.read()
    cases = []
    for i, (data, expect) in enumerate(((png, "good"), (png[: len(png) // 2], "bad"),
                                        (png_bomb(20000, 20000), "refused:ImageTooLargeError"))):
        p = tmp_path / "c" / f"png-{i}.png"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
        cases.append(dict(id=f"png-{i}", family="png", kind="image", path=str(p), damage="d",
                          detail="", expect=expect))  # fmt: skip
    recs = {r["id"]: r for r in harness.run_extract_folder(tmp_path / "c", tmp_path / "out",
                                                           cases=cases)}  # fmt: skip
    assert [recs[f"png-{i}"]["outcome"] for i in range(3)] == ["decoded", "typed_error",
                                                               "typed_error"]  # fmt: skip
    assert "ImageTooLargeError" in recs["png-2"]["error"]


_FORK = r"""
import os, signal, sys, threading
from avpipe.decoding.image import _isolated, decode_image_batch
data = open(sys.argv[1], "rb").read()
assert not decode_image_batch([data], device="cpu").errors
helper = _isolated._STATE["proc"].pid
busy = threading.Thread(target=_isolated._LOCK.acquire)  # a decode under way on another thread
busy.start()
busy.join()
pid = os.fork()
if pid == 0:  # the child decodes through a helper of its own, and leaves the parent's alone
    signal.alarm(60)  # a lock inherited held: a deadlock, ended here
    ok = not decode_image_batch([data], device="cpu").errors
    ok = ok and _isolated._STATE["proc"].pid != helper
    sys.exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
_isolated._LOCK.release()
assert not decode_image_batch([data], device="cpu").errors
assert _isolated._STATE["proc"].pid == helper, "the child's exit killed the parent's helper"
print("ok")
"""


def test_forked_child_uses_its_own_helper(tmp_path):
    p = tmp_path / "hidden.jp2"
    p.write_bytes(hide_header(_j2k(False)))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _FORK, str(p)], capture_output=True, text=True,
                       timeout=150, env=env)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_max_pixels_on_the_feeds_and_the_stream(tmp_path):
    from avpipe.pipeline.image_folder import ImageFolder
    from avpipe.pipeline.image_stream import decode_image_stream
    from avpipe.recipes import image_classification

    jpg, png = (os.path.join(SAMPLES, n) for n in ("scene.jpg", "scene.png"))
    (b,) = decode_image_stream([jpg, png], batch_size=2, device="cpu", max_pixels=1000)
    assert [type(e).__name__ for _, e in b.errors] == ["ImageTooLargeError"] * 2
    feed = image_classification([(jpg, "a"), (png, "b")], crop_size=16, resize_size=20,
                                batch_size=2, train=False, device="cpu", max_pixels=1000)
    assert sum(len(x.paths) for x in feed) == 0
    assert sorted(p for p, _ in feed.errors) == sorted([jpg, png])
    assert all(m.startswith("ImageTooLargeError") for _, m in feed.errors)
    with pytest.raises(ValueError, match="max_pixels.*-5"):
        image_classification([(jpg, "a")], device="cpu", max_pixels=-5)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jpg").write_bytes(open(jpg, "rb").read())
    f = ImageFolder(tmp_path, device="cpu", max_pixels=1000)
    assert sum(len(x.paths) for x in f) == 0 and len(f.errors) == 1
    assert len(next(iter(ImageFolder(tmp_path, device="cpu"))).paths) == 1


@pytest.mark.parametrize("how", ["hang", "segv", "no_python"])
def test_helper_failures_are_typed_errors_naming_the_file(monkeypatch, how):
    """A helper that hangs is killed after ``TIMEOUT_S`` (DecodeTimeoutError); one that dies
    gives a CorruptDataError naming the signal; one that cannot start, a DecodeError."""
    from avpipe.decoding.image import _isolated
    from avpipe.errors import CorruptDataError, DecodeError, DecodeTimeoutError

    code = {"hang": "import time; time.sleep(60)",
            "segv": "import os, signal, sys; sys.stdin.buffer.read(8); "
                    "os.kill(os.getpid(), signal.SIGSEGV)"}  # fmt: skip

    def start():
        if how == "no_python":
            raise FileNotFoundError("no interpreter")
        return subprocess.Popen([sys.executable, "-c", code[how]], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)  # fmt: skip

    monkeypatch.setattr(_isolated, "_start", start)
    monkeypatch.setattr(_isolated, "TIMEOUT_S", 2.0)
    monkeypatch.setitem(_isolated._STATE, "proc", None)
    img, err = _isolated.decode("some/file.jp2", b"data", None, True, "JPEG 2000 decoder")
    assert img is None and "some/file.jp2" in str(err)
    want = {"hang": DecodeTimeoutError, "segv": CorruptDataError, "no_python": DecodeError}[how]
    assert type(err) is want, err
    if how == "segv":
        assert "SIGSEGV" in str(err)
    assert _isolated._STATE["proc"] is None  # the next image starts a fresh helper
