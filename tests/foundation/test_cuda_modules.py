"""The one CUDA module loader (avpipe.device.cuda_modules), run on the CPU with a stand-in for
CuPy: sources read from the ``.cu`` files beside a module, compiled once per (source, options,
device), one fallback rule; and every kernel of the package goes through it."""

from __future__ import annotations

import logging
import pathlib
import re
import sys
import threading

import pytest
import tomllib
from paths import REPO

from avpipe.device import cuda_modules as CM

ROOT = pathlib.Path(REPO)
PACKAGE = ROOT / "avpipe"


class _Device:
    current = [0]

    def __init__(self, i=0):
        self.id = int(i)

    def __enter__(self):
        self._was = _Device.current[0]
        _Device.current[0] = self.id
        return self

    def __exit__(self, *a):
        _Device.current[0] = self._was
        return False


class FakeCupy:
    """Just enough of cupy for the loader: a RawModule that records what it compiled (and on
    which device), failing on a source with ``#error`` as NVRTC would."""

    compiles: list = []

    class cuda:
        Device = _Device

    class RawModule:
        def __init__(self, code, options=()):
            if "#error" in code:
                raise RuntimeError("NVRTC_ERROR_COMPILATION")
            FakeCupy.compiles.append((code, tuple(options), _Device.current[0]))
            self.code = code

        def get_function(self, name):
            if name not in self.code:
                raise AttributeError(f"no kernel {name}")
            return ("kernel", name, _Device.current[0])

    class ElementwiseKernel:
        def __init__(self, in_params, out_params, body, name, **kw):
            FakeCupy.compiles.append((body, name))
            self.name = name


@pytest.fixture
def cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    FakeCupy.compiles = []
    CM.clear_cache()
    yield FakeCupy
    CM.clear_cache()


@pytest.fixture
def sources(tmp_path):
    """A module file and two kernel sources beside it."""
    (tmp_path / "k.cu").write_text('extern "C" __global__ void avp_a() {}\n'
                                   'extern "C" __global__ void avp_b() {}\n')
    (tmp_path / "broken.cu").write_text("#error deliberately broken\n")
    module = tmp_path / "mod.py"
    module.write_text("")
    return str(module)


def test_source_is_the_files_beside_the_module_after_the_table_and_prelude(sources):
    m = CM.CudaModule(sources, "k.cu", names=("avp_a",), table=True, prelude="// prelude\n")
    text = m.source
    assert text.startswith(CM.TABLE_CUDA) and "@WORDS@" not in text
    assert f"#define AVP_TABLE_WORDS {CM.TABLE_BYTES // 8}\n" in CM.TABLE_CUDA
    assert text.index("// prelude") < text.index("avp_a")
    assert text.endswith("void avp_b() {}\n")
    assert m.source is text  # read once: the same object, the cache's key
    plain = CM.CudaModule(sources, "k.cu", names=("avp_a",))
    assert plain.source == pathlib.Path(sources).with_name("k.cu").read_text()


def test_compiled_once_per_source_options_and_device(cupy, sources):
    m = CM.CudaModule(sources, "k.cu", names=("avp_a", "avp_b"))
    got = m.get(0)
    assert got == {"avp_a": ("kernel", "avp_a", 0), "avp_b": ("kernel", "avp_b", 0)}
    assert m.get(0) is got and len(cupy.compiles) == 1
    # the same source and options from another declaration: the same compiled module
    assert CM.CudaModule(sources, "k.cu", names=("avp_a", "avp_b")).get(0) is got
    assert len(cupy.compiles) == 1
    # another device, other options: compiled again, each on its own device
    assert m.get(1)["avp_a"] == ("kernel", "avp_a", 1)
    CM.CudaModule(sources, "k.cu", names=("avp_a",), options=("-std=c++14",)).get(0)
    assert [(o, d) for _, o, d in cupy.compiles] == [((), 0), ((), 1), (("-std=c++14",), 0)]
    CM.clear_cache()
    m.get(0)
    assert len(cupy.compiles) == 4


def test_threads_asking_at_once_compile_once(cupy, sources):
    m = CM.CudaModule(sources, "k.cu", names=("avp_a",))
    got = []
    threads = [threading.Thread(target=lambda: got.append(m.get(0))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cupy.compiles) == 1 and all(g is got[0] for g in got)


def test_a_module_with_a_fallback_warns_once_and_returns_none(cupy, sources, caplog):
    m = CM.CudaModule(sources, "broken.cu", names=("avp_a",), fallback="test")
    with caplog.at_level(logging.WARNING, logger="avpipe"):
        assert m.get(0) is None
        assert m.get(0) is None
        assert m.get(1) is None
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["avpipe: test kernels failed to compile (RuntimeError: "
                      "NVRTC_ERROR_COMPILATION); using the slower array-module path"]


def test_a_module_without_a_fallback_raises_and_tries_again(cupy, sources, tmp_path):
    m = CM.CudaModule(sources, "k.cu", names=("avp_missing",))
    for _ in range(2):  # not remembered: the next call compiles again
        with pytest.raises(AttributeError, match="avp_missing"):
            m.get(0)
    assert len(cupy.compiles) == 2


def test_elementwise_kernels_are_made_once(cupy):
    a = CM.elementwise("float32 x", "float32 y", "y = x;", "avp_copy")
    assert CM.elementwise("float32 x", "float32 y", "y = x;", "avp_copy") is a
    assert len(cupy.compiles) == 1


def test_fragments_put_together(tmp_path):
    (tmp_path / "f.cu").write_text("// a file of fragments\n//@@ inner\nint x = 1;\n\n"
                                   "//@@ outer\n{\n  @inner@\n}\n")
    got = CM.read_fragments(str(tmp_path / "m.py"), "f.cu")
    assert got == {"inner": "int x = 1;\n", "outer": "{\nint x = 1;\n}\n"}
    (tmp_path / "loop.cu").write_text("//@@ a\n@b@\n//@@ b\n@a@\n")
    with pytest.raises(ValueError, match="includes itself"):
        CM.read_fragments(str(tmp_path / "m.py"), "loop.cu")


def test_every_kernel_source_is_a_cu_file_loaded_through_the_loader():
    """No CUDA source in a Python string, no module of the package compiling kernels itself,
    and every ``.cu`` / ``.cuh`` file named by a loader call and shipped as package data."""
    py = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    loader = PACKAGE / "device" / "cuda_modules.py"
    for path, text in py.items():
        assert "__global__" not in text, f"{path}: CUDA source in Python"
        if path != loader:
            assert not re.search(r"\b(RawModule|RawKernel|ElementwiseKernel)\(", text), path
    named = "\n".join(py.values())
    cu = sorted(p for ext in ("*.cu", "*.cuh") for p in PACKAGE.rglob(ext))
    assert cu
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    for path in cu:
        assert f'"{path.name}"' in named, f"{path.name}: not loaded by any module"
        pkg = ".".join(path.parent.relative_to(ROOT).parts)
        assert any(path.match(g) for g in package_data.get(pkg, ())), f"{path}: not package data"


def test_each_modules_kernels_name_kernels_of_its_source():
    """Every name a module declares is in its source (a typo would surface only on a GPU):
    declared ``extern "C" __global__``, or made by a macro of the source (``AVP_HPASS(name,
    ...)``)."""
    from avpipe.decoding.audio import _flac_cuda
    from avpipe.ops import (
        _image_augment_kernels,
        _log_mel,
        _resample,
        _resize_kernels,
        _spec_augment,
        color,
        random,
    )

    mods = [_flac_cuda._KERNELS, _image_augment_kernels.KERNELS, _log_mel._KERNELS,
            _resample._KERNELS, _resize_kernels._KERNELS, _spec_augment._KERNELS,
            color._KERNELS, random._NORMAL_ROWS]  # fmt: skip
    for m in mods:
        for name in m.names:
            assert re.search(rf'(extern "C" __global__ void |^[A-Z_]+\(){name}\b', m.source,
                             re.MULTILINE), name
