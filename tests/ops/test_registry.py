"""One operator registry (avpipe.ops.registry): an operator registered once is usable in an
augmentation chain, in an extraction preset (Python or TOML), and is listed by
``avpipe extract --help`` and docs/presets.md."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from paths import REPO

from avpipe.ops import registry
from avpipe.ops.audio import log_mel
from avpipe.ops.audio_augment import Chain, LogMel
from avpipe.ops.image_augment import Normalize
from avpipe.recipes.extract._presets import (
    PresetError,
    describe_operators,
    preset_ops,
    resolve_preset,
)
from avpipe.recipes.extract._process import apply_audio_ops

DOCS = Path(REPO) / "docs"


@pytest.fixture
def scale_op():
    """A tiny operator, registered for the test only: features times ``factor``."""

    @registry.register("test_scale", kind="audio", stage="features")
    def test_scale(data, *, factor: float = 2.0):
        feats, frame_lengths = data
        return feats * np.float32(factor), frame_lengths

    yield test_scale
    registry.unregister("test_scale", "audio")


def _batch():
    rng = np.random.default_rng(3)
    x = np.zeros((2, 8000), np.float32)
    lens = np.array([8000, 5000], np.int64)
    for i, n in enumerate(lens):
        x[i, :n] = rng.standard_normal(n).astype(np.float32) * 0.1
    return x, lens


def test_one_registration_serves_chains_presets_and_help(scale_op, tmp_path):
    x, lens = _batch()
    ref, ref_fl = log_mel(x, lens, preset="nemo")
    # an augmentation chain
    chain = Chain.from_config([{"op": "log_mel", "preset": "nemo"},
                               {"op": "test_scale", "factor": 3.0}])
    feats, fl = chain((x, lens), seed=0)
    np.testing.assert_array_equal(feats, ref * np.float32(3.0))
    np.testing.assert_array_equal(fl, ref_fl)
    # a TOML preset, resolved and applied as extraction does
    p = tmp_path / "scaled.toml"
    p.write_text('[audio]\nops = [{op = "log_mel", preset = "nemo"}, '
                 '{op = "test_scale", factor = 3.0}]\n')
    cfg = resolve_preset(str(p))
    assert cfg["audio"]["ops"][1] == {"op": "test_scale", "factor": 3.0}
    got, got_fl = apply_audio_ops(x, lens, 16000, cfg["audio"]["ops"])
    np.testing.assert_array_equal(got, feats)
    np.testing.assert_array_equal(got_fl, ref_fl)
    # its parameters are checked by the entry, in both
    p.write_text('[audio]\nops = [{op = "log_mel"}, {op = "test_scale", factor = "x"}]\n')
    with pytest.raises(PresetError, match=r"ops\[1\] \(test_scale\): factor must be a number, "
                                          r"got 'x'"):
        resolve_preset(str(p))
    with pytest.raises(ValueError, match=r"config\[0\] \(test_scale\): unknown argument"):
        Chain.from_config([{"op": "test_scale", "fator": 2}])
    # and listed where presets are described
    assert "test_scale(factor=2.0)" in describe_operators()
    from click.testing import CliRunner

    from avpipe.cli.main import cli

    r = CliRunner().invoke(cli, ["extract", "--help"])
    assert r.exit_code == 0 and "test_scale(factor=2.0)" in r.output
    assert "test_scale" in Chain.ops_available()


def test_presets_take_only_deterministic_ops_in_stage_order():
    with pytest.raises(PresetError, match="'gain' .an augmentation"):
        resolve_preset({"audio": {"ops": [{"op": "gain"}]}})
    with pytest.raises(PresetError, match=r"the first operator must take a signal.*"
                                          r"put one of \['log_mel', 'mel'\]"):
        resolve_preset({"audio": {"ops": [{"op": "log"}]}})
    with pytest.raises(PresetError, match=r"ops\[1\] \(mel\) takes signal, but the operators "
                                          r"before it give features"):
        resolve_preset({"audio": {"ops": [{"op": "log_mel"}, {"op": "mel"}]}})
    with pytest.raises(PresetError, match="sample_rate is the preset's"):
        resolve_preset({"audio": {"ops": [{"op": "log_mel", "sample_rate": 8000}]}})
    with pytest.raises(PresetError, match=r"unknown operator 'normalize' \(it takes pixels and "
                                          r"gives tensor"):
        resolve_preset({"image": {"ops": [{"op": "normalize"}]}})
    with pytest.raises(PresetError, match="n_mels must be an int, got 'x'"):
        resolve_preset({"audio": {"ops": [{"op": "log_mel", "n_mels": "x"}]}})


def test_entries_and_names():
    e = registry.get("mfcc")
    assert (e.kind, e.stage, e.gives, e.random) == ("audio", "features", "features", False)
    assert e.params["n_mfcc"].default == 20
    assert registry.get("speed_perturb").random and registry.get("log_mel").target is LogMel
    assert "random_resized_crop" in registry.names(kind="image")
    assert "random_resized_crop" not in registry.names(kind="audio")
    with pytest.raises(KeyError, match="registered for audio and image"):
        registry.get("normalize")
    with pytest.raises(KeyError, match="unknown operator 'nope'"):
        registry.get("nope")
    e.check({"n_mfcc": np.int64(13)})  # numpy scalars are numbers
    with pytest.raises(ValueError, match="n_mfcc must be an int, got 13.0"):
        e.check({"n_mfcc": 13.0})
    with pytest.raises(ValueError, match="missing argument"):
        registry.get("crop_pad").check({})
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mfcc", kind="audio", stage="features")(lambda data: data)


def test_chain_picks_the_kind_of_a_shared_name():
    assert isinstance(Chain.from_config([{"op": "flip"}, {"op": "normalize"}]).ops[1], Normalize)
    c = Chain.from_config([{"op": "log_mel"}, {"op": "normalize", "mode": "all_features"}])
    assert c.ops[1].entry is registry.get("normalize", "audio")
    assert isinstance(Chain.from_config([{"op": "normalize"}], kind="image").ops[0], Normalize)
    with pytest.raises(ValueError, match="pass kind="):
        Chain.from_config([{"op": "normalize"}])


def _doc_table(text, heading):
    part = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", part, flags=re.M)
    return dict(rows)


def test_presets_page_lists_the_registry():
    text = (DOCS / "presets.md").read_text()
    for heading, kind in (("### Audio operators", "audio"),
                          ("### Video frame and image operators", "image")):
        rows = _doc_table(text, heading)
        entries = {e.name: e for e in preset_ops(kind)}
        assert sorted(rows) == sorted(entries), heading
        for name, e in entries.items():
            for p in e.params.values():
                if p.name in e.context or p.default is registry.INHERITED:
                    continue
                assert f"`{p.name}`" in rows[name], (name, p.name)
