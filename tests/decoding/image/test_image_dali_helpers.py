"""The DALI image pipeline's pure-Python helpers (no DALI needed): lazy batch views and the
hardware-JPEG-decoder setting."""

from __future__ import annotations

import numpy as np
import pytest

from avpipe.decoding.image import _dali as dali


def test_rows_are_views_of_the_stacked_batch():
    dense = np.arange(4 * 2 * 3 * 3, dtype=np.uint8).reshape(4, 2, 3, 3)
    rows = dali.Rows(dense)
    assert len(rows) == 4
    for i, im in enumerate(rows):  # iteration stops at the end (IndexError protocol)
        assert im.shape == (2, 3, 3)
        assert np.shares_memory(im, dense)
        np.testing.assert_array_equal(im, dense[i])
    np.testing.assert_array_equal(rows[-1], dense[3])
    head = rows[:3]  # the stream trims a padded last batch this way
    assert len(head) == 3 and np.shares_memory(head[2], dense)
    np.testing.assert_array_equal(head[2], dense[2])
    with pytest.raises(IndexError, match="out of range"):
        rows[4]
    with pytest.raises(IndexError):
        rows[-5]
    with pytest.raises(TypeError):
        rows[1.0]
    assert [im[0, 0, 0] for im in rows[1:]] == [dense[i, 0, 0, 0] for i in (1, 2, 3)]


def test_hw_decoder_load_default_and_env(monkeypatch):
    monkeypatch.delenv("AVPIPE_JPEG_HW_LOAD", raising=False)
    assert dali.hw_decoder_load() == 1.0
    assert dali.mixed_options(False) == {"hw_decoder_load": 1.0}
    assert dali.mixed_options(True) == {"hw_decoder_load": 1.0, "jpeg_fancy_upsampling": True}
    key_default = dali._key(0, 8, False, True)
    monkeypatch.setenv("AVPIPE_JPEG_HW_LOAD", "0.65")
    assert dali.hw_decoder_load() == 0.65
    # a new value keys a new pipeline (GPU only; the CPU decoder has no hardware share)
    key_065 = dali._key(0, 8, False, True)
    assert key_default[-1] == 1.0 and key_065[-1] == 0.65 and key_065 != key_default
    assert key_065[:-1] == key_default[:-1]
    assert dali._key(None, 8, False, True)[-1] is None
    for bad in ("1.5", "-0.1", "half", "nan"):
        monkeypatch.setenv("AVPIPE_JPEG_HW_LOAD", bad)
        with pytest.raises(ValueError, match=f"AVPIPE_JPEG_HW_LOAD .*{bad!r}"):
            dali.hw_decoder_load()


def test_build_with_fallback_drops_options_one_step_at_a_time(caplog, monkeypatch):
    monkeypatch.setattr(dali, "_DROPPED", set())
    seen = []

    def build_refusing(refused):
        def build(opts):
            seen.append(dict(opts))
            if refused & set(opts) or "everything" in refused:
                raise RuntimeError(f"unknown argument {sorted(refused & set(opts))}")
            return "pipe"

        return build

    full = {"hw_decoder_load": 1.0, "jpeg_fancy_upsampling": True}
    assert dali.build_with_fallback(build_refusing(set()), full) == "pipe"
    assert seen == [full]
    seen.clear()
    # an older DALI without fancy upsampling keeps the hardware share
    assert dali.build_with_fallback(build_refusing({"jpeg_fancy_upsampling"}), full) == "pipe"
    assert seen == [full, {"hw_decoder_load": 1.0}]
    assert "jpeg_fancy_upsampling" in caplog.text
    seen.clear()
    assert dali.build_with_fallback(build_refusing({"hw_decoder_load"}), full) == "pipe"
    assert seen == [full, {"hw_decoder_load": 1.0}, {}]
    seen.clear()
    with pytest.raises(RuntimeError):  # a failure without options is DALI's own: raised
        dali.build_with_fallback(build_refusing({"everything"}), {})
    assert seen == [{}]

