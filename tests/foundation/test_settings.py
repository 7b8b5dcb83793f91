"""avpipe.settings: every AVPIPE_* variable, one grammar, read at call time."""

from __future__ import annotations

import pathlib
import re

import pytest

from avpipe import settings


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " on ", "Yes"])
def test_bool_true(monkeypatch, value):
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", value)
    assert settings.disable_gpu() is True


@pytest.mark.parametrize("value", ["0", "false", "False", "off", "NO"])
def test_bool_false(monkeypatch, value):
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", value)
    assert settings.disable_gpu() is False


def test_bool_unset_or_empty_is_default(monkeypatch):
    monkeypatch.delenv("AVPIPE_IMAGE_KERNELS", raising=False)
    assert settings.image_kernels() is True
    monkeypatch.setenv("AVPIPE_IMAGE_KERNELS", "  ")
    assert settings.image_kernels() is True


@pytest.mark.parametrize("name", [n for n in settings.VARIABLES])
def test_bad_values_name_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name} .*'maybe'"):
        settings.VARIABLES[name]()


def test_numbers(monkeypatch):
    monkeypatch.setenv("AVPIPE_NVDEC_CHUNK", "4")
    assert settings.nvdec_chunk() == 4
    for auto in ("auto", " Auto ", ""):
        monkeypatch.setenv("AVPIPE_NVDEC_CHUNK", auto)
        assert settings.nvdec_chunk() is None  # the packet path picks by frame size
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv("AVPIPE_NVDEC_CHUNK", bad)
        want = f"AVPIPE_NVDEC_CHUNK must be auto or an integer >= 1, got '{bad}'"
        with pytest.raises(ValueError, match=want):
            settings.nvdec_chunk()
    monkeypatch.setenv("AVPIPE_FLAC_WINDOW", "0")
    with pytest.raises(ValueError, match="AVPIPE_FLAC_WINDOW must be an integer >= 1, got '0'"):
        settings.flac_window()
    monkeypatch.setenv("AVPIPE_JPEG_HW_LOAD", "0.5")
    assert settings.jpeg_hw_load() == 0.5
    for bad in ("1.5", "nan", "-0"):
        monkeypatch.setenv("AVPIPE_JPEG_HW_LOAD", bad)
        if bad == "-0":
            assert settings.jpeg_hw_load() == 0.0
            continue
        with pytest.raises(ValueError, match="AVPIPE_JPEG_HW_LOAD"):
            settings.jpeg_hw_load()
    monkeypatch.delenv("AVPIPE_DALI_THREADS", raising=False)
    assert settings.dali_threads() is None


def test_nvdec_packets_modes(monkeypatch):
    monkeypatch.delenv("AVPIPE_NVDEC_PACKETS", raising=False)
    assert settings.nvdec_packets() == "auto"
    for v, want in (("AUTO", "auto"), ("yes", "on"), ("1", "on"), ("off", "off"), ("0", "off")):
        monkeypatch.setenv("AVPIPE_NVDEC_PACKETS", v)
        assert settings.nvdec_packets() == want


def test_disable_gpu_read_at_call_time(monkeypatch):
    from avpipe import device as D

    monkeypatch.setenv("AVPIPE_DISABLE_GPU", "1")
    assert D.default_device() == D.Device("cpu")
    monkeypatch.setenv("AVPIPE_DISABLE_GPU", "false")  # "false" no longer disables the GPU
    assert D.gpu_available() == (D.devices._cuda_device_count() > 0)


def test_every_variable_in_the_code_is_a_setting():
    """No module reads an AVPIPE_* variable itself: only avpipe/settings.py does."""
    root = pathlib.Path(settings.__file__).parent
    readers = []
    for p in root.rglob("*.py"):
        if p.name == "settings.py":
            continue
        text = p.read_text()
        if re.search(r"environ(\.get)?\(?\[?[\"']AVPIPE_|getenv\([\"']AVPIPE_", text):
            readers.append(str(p))
    assert not readers


def test_docs_settings_table_lists_every_variable():
    page = (pathlib.Path(settings.__file__).parents[1] / "docs" / "settings.md").read_text()
    rows = set(re.findall(r"^\| `(AVPIPE_[A-Z_]+)`", page, re.M))
    assert rows == set(settings.VARIABLES)
