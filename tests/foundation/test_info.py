from __future__ import annotations

import subprocess
import sys

import pytest

import avpipe


def test_info_reports_versions_and_device():
    d = avpipe.info()
    assert d["avpipe"] == avpipe.__version__
    assert d["versions"]["numpy"]
    assert d["versions"]["av"]
    assert d["default_device"] in ("cpu", "cuda:0")
    assert isinstance(d["gpus"], list)
    assert "nvdec_codecs" in d and "dali_image_decoders" in d


def test_info_cli_prints_report():
    out = subprocess.run([sys.executable, "-m", "avpipe", "info"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "default device:" in out.stdout
    assert "NVDEC codecs:" in out.stdout


def test_lazy_public_api():
    assert callable(avpipe.load_audio)
    assert callable(avpipe.decode_images)
    assert isinstance(avpipe.VideoDecoder, type)
    assert issubclass(avpipe.CorruptDataError, avpipe.DecodeError)
    with pytest.raises(AttributeError):
        avpipe.does_not_exist  # noqa: B018


@pytest.mark.gpu
def test_info_on_gpu_lists_nvdec_codecs():
    d = avpipe.info()
    assert d["gpus"] and d["cuda_driver"]
    assert isinstance(d["nvdec_codecs"], list), d["nvdec_codecs"]
    assert {"h264", "hevc"} <= set(d["nvdec_codecs"])


def test_ops_namespace_reexports_and_refuses_ambiguous_names():
    import avpipe.ops as ops

    assert ops.log_mel is ops.audio.log_mel
    assert ops.resize is ops.image.resize
    with pytest.raises(AttributeError, match="ambiguous: use avpipe.ops.audio.normalize or avpipe.ops.image.normalize"):
        ops.normalize  # noqa: B018
    with pytest.raises(AttributeError):
        ops.nope  # noqa: B018
