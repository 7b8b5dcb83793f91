"""The device layer: name resolution, array modules, DLPack export without copies."""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest

from avpipe import device as D
from avpipe._source import open_source, source_name
from avpipe.device import transfers as T


def test_resolve_names():
    assert D.resolve_device("cpu") == D.Device("cpu")
    assert str(D.resolve_device("CPU")) == "cpu"
    assert D.resolve_device(D.Device("cpu")).kind == "cpu"


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:0", "", "cuda:-1", 3])
def test_resolve_rejects_bad_names_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got"):
        D.resolve_device(bad)


def test_resolve_names_custom_parameter():
    with pytest.raises(ValueError, match="out_device"):
        D.resolve_device("tpu", param="out_device")


def test_default_is_cpu_without_gpu(monkeypatch):
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", "1")
    assert D.resolve_device(None) == D.Device("cpu")
    assert not D.gpu_available()
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        D.resolve_device("cuda")


def test_array_module_and_device_of_on_cpu():
    x = np.zeros(3)
    assert D.array_module(x) is np
    assert D.device_of(x) == D.Device("cpu")
    assert D.Device("cpu").xp is np


def test_to_torch_shares_memory():
    torch = pytest.importorskip("torch")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = D.to_torch(x)
    assert isinstance(t, torch.Tensor) and t.shape == (3, 4)
    x[0, 0] = 42.0  # a copy would not see this
    assert t[0, 0].item() == 42.0
    back = D.to_numpy(t)
    back[1, 1] = -1.0
    assert x[1, 1] == -1.0


def test_export_dispatch_and_validation():
    x = np.ones(2, dtype=np.float32)
    assert D.export(x, None) is x
    assert D.export(x, "numpy") is x
    with pytest.raises(ValueError, match="framework must be one of .* got 'mxnet'"):
        D.export(x, "mxnet")


def test_to_jax_when_available():
    jnp = pytest.importorskip("jax.numpy")
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(D.to_jax(x)), x)
    assert isinstance(D.to_jax(x), type(jnp.zeros(1)))


def test_sources(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(b"hello")
    s = open_source(p)
    assert s.name == str(p) and s.read_bytes() == b"hello"
    assert open_source(b"xy").name == "<bytes>"
    f = io.BytesIO(b"abc")
    f.read()
    s = open_source(f)
    assert s.read_bytes() == b"abc"  # rewound
    assert not f.closed  # ours must not close the caller's object
    with pytest.raises(FileNotFoundError, match="missing.wav"):
        open_source(tmp_path / "missing.wav")
    with pytest.raises(TypeError, match="source must be a path, bytes or a binary file-like"):
        open_source(12)
    assert source_name(bytearray(b"x")) == "<bytes>"


# ---- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_default_and_dlpack_zero_copy():
    import cupy as cp

    assert D.default_device().is_cuda
    assert D.resolve_device("cuda") == D.Device("cuda", 0)
    x = cp.arange(10, dtype=cp.float32)
    assert D.array_module(x) is cp
    assert D.device_of(x) == D.Device("cuda", 0)
    pytest.importorskip("torch")
    t = D.to_torch(x)
    assert t.is_cuda and t.data_ptr() == x.data.ptr  # same memory
    y = D.to_cupy(t)
    assert y.data.ptr == x.data.ptr
    np.testing.assert_array_equal(D.to_numpy(x), np.arange(10, dtype=np.float32))
    z = D.to_device(np.ones(3), "cuda")
    assert D.device_of(z).is_cuda
    with D.stream("cuda") as s:
        assert s is not None
        w = cp.ones(4) * 2
    s.synchronize()
    assert float(w.sum()) == 8.0


@pytest.mark.gpu
def test_gpu_to_jax_roundtrip():
    jax = pytest.importorskip("jax")
    import cupy as cp

    x = cp.arange(6, dtype=cp.float32)
    j = D.to_jax(x)
    assert np.asarray(j).tolist() == list(range(6))
    if jax.default_backend() == "gpu":  # a GPU JAX keeps it on the GPU
        assert all(d.platform == "gpu" for d in j.devices())


@pytest.mark.gpu
def test_gpu_upload_many_is_queued_on_the_stream_and_exact():
    """On a GPU ``upload_many`` copies from pinned memory on the current stream without waiting
    for it: copies queued behind other work arrive exact, in order with that work, and the
    pinned buffers of finished copies are let go."""
    import cupy as cp

    rng = np.random.default_rng(1)
    s = cp.cuda.Stream(non_blocking=True)
    sent, got = [], []
    with s:
        big = cp.zeros(1 << 24, cp.float32)
        for k in range(40):
            arrays = [rng.integers(-9, 9, 64).astype(np.int64), rng.standard_normal(33)
                      .astype(np.float32), np.full((3, 5), k, np.int32)]  # fmt: skip
            big += 1.0  # work queued ahead of each copy
            sent.append(arrays)
            got.append(D.upload_many(cp, arrays))
        s.synchronize()
    assert float(big[0]) == 40.0
    for arrays, views in zip(sent, got):
        for a, v in zip(arrays, views):
            assert v.dtype == a.dtype and v.shape == a.shape
            np.testing.assert_array_equal(cp.asnumpy(v), a)
    with s:
        D.upload_many(cp, [np.arange(3)])
    assert len(T._IN_FLIGHT) <= 2
    with s:  # wait=True: complete on return, for any stream, while s is still busy
        big += 1.0
        (v,) = D.upload_many(cp, [np.arange(7, dtype=np.int64)], wait=True)
        inflight = len(T._IN_FLIGHT)
    other = cp.cuda.Stream(non_blocking=True)
    with other:
        got2 = cp.asnumpy(v * 2)
    np.testing.assert_array_equal(got2, 2 * np.arange(7))
    assert inflight == len(T._IN_FLIGHT)  # nothing held for it


def test_pinned_size_rounds_up_by_at_most_an_eighth_to_few_sizes():
    sizes = {D.pinned_size(n) for n in range(1, 1 << 20, 37)}
    for n in [1, 4095, 4096, 4097, 9_437_184, 9_437_185, (1 << 30) + 1]:
        m = D.pinned_size(n)
        assert m >= max(n, 4096) and m <= max(n, 4096) * 9 / 8
        assert D.pinned_size(m) == m  # a rounded size is its own bucket
    assert len(sizes) <= 8 * 8 + 1  # eight sizes an octave from 4 KiB to 1 MiB


def test_download_leaves_host_arrays_as_they_are():
    a, b = np.arange(6).reshape(2, 3), [1, 2]
    (ha, hb), event = D.download([a, b])
    assert event is None and ha is a and hb.tolist() == [1, 2]


@pytest.mark.gpu
def test_gpu_download_is_queued_behind_the_streams_work_and_exact():
    """``download`` queues its copies on the current stream without waiting: after the event,
    the host arrays hold what the work queued before them wrote (a strided view is copied
    contiguous), in page-locked memory."""
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.zeros((64, 80, 1500), cp.float32)
        for _ in range(20):
            x += 1.0  # work queued ahead of the copy
        v = x[:, :, :997]  # not contiguous
        (hx, hv, hn), event = D.download([x, v, cp.arange(5)])
    event.synchronize()
    assert np.all(hx == 20.0) and hv.shape == (64, 80, 997) and np.all(hv == 20.0)
    assert hn.tolist() == [0, 1, 2, 3, 4]
    assert hx.base is not None  # a view of the pinned block, not a copy


@pytest.mark.gpu
def test_gpu_resampling_tap_bank_grows_and_equals_the_reference(monkeypatch):
    """The kernel's taps stay on the device across batches (a bank that grows when a batch
    brings new rate pairs); past the bank's size a batch uploads its own. Either way the rows
    equal the array-module reference."""
    import cupy as cp

    from avpipe.ops import _resample as R

    banks = {}
    monkeypatch.setattr(R, "_bank", lambda dev, q: banks.setdefault((dev, q), R._TapBank(dev, q)))
    monkeypatch.setattr(R._TapBank, "MAX_PAIRS", 6)
    rng = np.random.default_rng(5)
    for rates in ([13600, 16000, 17000, 16000], [13600, 18400, 14400, 16000],
                  [8000, 11025, 22050, 44100, 12000, 13000, 15000]):  # the last: past 6 pairs
        B = len(rates)
        lens = rng.integers(1000, 6000, B)
        x = np.zeros((B, int(lens.max())), np.float32)
        for b, m in enumerate(lens):
            x[b, :m] = rng.standard_normal(m)
        ref, new_ref = R.resample_rows(x, lens, np.array(rates), 16000, quality="fast")
        out, new = R.resample_rows(cp.asarray(x), lens, np.array(rates), 16000, quality="fast")
        np.testing.assert_array_equal(np.asarray(new), new_ref)
        np.testing.assert_allclose(cp.asnumpy(out), ref, atol=2e-6, rtol=2e-6)
    bank = banks[(0, "fast")]
    assert len(bank.pairs) == 5 and len(bank.retired) == 1  # grown once; the third batch: its own


def test_pinned_sources_are_let_go_in_order_and_only_when_copied(monkeypatch):
    """``upload_many``'s pinned sources (``keep_until_done``): a source is let go only once
    its copy's event is done and every earlier one's is, also with several threads copying."""
    import threading

    monkeypatch.setattr(T, "_IN_FLIGHT", collections.deque())

    class Ev:
        def __init__(self, done):
            self.done = done

    pending = Ev(False)
    D.keep_until_done(Ev(True), "a")
    D.keep_until_done(pending, "b")
    D.keep_until_done(Ev(True), "c")
    assert [m for _, m in T._IN_FLIGHT] == ["b", "c"]  # "a" let go; "c" waits behind "b"
    events = [Ev(False) for _ in range(400)]

    def copier(k):
        for e in events[k::4]:
            D.keep_until_done(e, e)

    threads = [threading.Thread(target=copier, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = {id(m) for _, m in T._IN_FLIGHT}
    assert all(id(e) in held for e in events)  # none let go before its copy was done
    pending.done = True
    for e in events:
        e.done = True
    D.keep_until_done(Ev(True), "d")
    assert not T._IN_FLIGHT
