"""Presets: what to extract from each kind of input, as plain data.

A preset is a dict (the same shape a TOML file gives, see :func:`load_preset_file`)::

    name = "my_features"
    description = "one line for --help"
    batch_size = 64                     # audio items per feature batch (optional)

    [audio]                             # decode settings, then the operators in order
    sample_rate = 16000                 # every file is resampled to it
    ops = [{op = "log_mel", preset = "nemo", n_mels = 64}]
    dtype = "float16"                   # the stored features (default "float32")

    [video]
    sampler = "fps"                     # "uniform" (num_frames), "fps" (fps) or "clips"
    fps = 1.0                           #   (clip_length, num_clips, stride)
    ops = [{op = "resize", short_side = 256}, {op = "center_crop", size = 224}]

    [image]
    ops = [{op = "resize", short_side = 224}, {op = "center_crop", size = 224}]

Only the kinds present are extracted (their files are picked by extension). Operators:

* audio (a padded batch ``[B, n]`` with lengths; the first must make features):
  ``log_mel`` (``preset`` = nemo / nemo_v1 / mlperf_rnnt, plus any
  :class:`avpipe.ops.audio.LogMelConfig` field to override), ``mel`` (power mel spectrogram:
  n_fft, win_length, hop_length, n_mels, fmin, fmax, window, center, pad_mode, power, htk,
  norm), ``log`` (guard, guard_value), ``power_to_db`` (ref, amin, top_db), ``mfcc``
  (n_mfcc, norm), ``normalize`` (mode, eps, ddof), ``stack_frames`` (stacking, subsampling).
* video frames and images (uint8 RGB ``[N, H, W, 3]``): ``resize`` (short_side, or size
  [h, w]; interpolation, antialias), ``center_crop`` (size).

The schema, with examples, is documented for users in docs/presets.md.

Values are checked when the preset is read (the audio operators run once on a short signal),
so a bad one stops the command before anything is written. The full, normalized preset is
stored in the output's ``extract.json`` and each kind's part in every index line (``params``).
The audio ``dtype`` appears there only when it is not the default float32 (so a float32 job's
files are what they were before the option existed); each index line's ``dtype`` is the stored
array's either way.
"""

from __future__ import annotations

import copy
import os
from dataclasses import fields

import numpy as np

from ..._validate import check_choice, pos_int  # noqa: E402
from ...formats import AUDIO_EXTENSIONS, IMAGE_EXTENSIONS, VIDEO_EXTENSIONS  # noqa: E402
from ...ops import audio as audio_ops
from ...ops import image as image_ops
from ._process import apply_audio_ops

EXTENSIONS = {"audio": AUDIO_EXTENSIONS, "video": VIDEO_EXTENSIONS, "image": IMAGE_EXTENSIONS}
KINDS = ("audio", "video", "image")
AUDIO_DTYPES = ("float32", "float16")  # the features are computed in float32, then cast
DEFAULT_BATCH_SIZE = 64

_CROP224 = [{"op": "resize", "short_side": 224}, {"op": "center_crop", "size": 224}]

BUILTIN: dict[str, dict] = {
    "quickstart": {
        "description": "audio: NeMo log-mel; video: 8 frames 224x224; images: 224x224",
        "audio": {"sample_rate": 16000, "ops": [{"op": "log_mel", "preset": "nemo"}]},
        "video": {"sampler": "uniform", "num_frames": 8, "ops": _CROP224},
        "image": {"ops": _CROP224},
    },
    "nemo": {
        "description": "audio: NeMo 2.x log-mel [80, T] float32, 16 kHz (ops.log_mel)",
        "audio": {"sample_rate": 16000, "ops": [{"op": "log_mel", "preset": "nemo"}]},
    },
    "nemo_v1": {
        "description": "audio: NeMo 1.x log-mel [80, T] float32 (n // 160 + 1 frames)",
        "audio": {"sample_rate": 16000, "ops": [{"op": "log_mel", "preset": "nemo_v1"}]},
    },
    "mlperf_rnnt": {
        "description": "audio: MLPerf RNN-T log-mel [80, T] float32, 16 kHz (ops.log_mel)",
        "audio": {"sample_rate": 16000, "ops": [{"op": "log_mel", "preset": "mlperf_rnnt"}]},
    },
    "mfcc": {
        "description": "audio: 20 MFCCs [20, T] float32 (80 mels, 25/10 ms, dB, DCT-II)",
        "audio": {"sample_rate": 16000, "ops": [
            {"op": "mel", "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": 80},
            {"op": "power_to_db", "top_db": 80.0},
            {"op": "mfcc", "n_mfcc": 20},
        ]},
    },
    "frames": {
        "description": "video: RGB frames at --fps N (default 1) [N, 224, 224, 3] uint8",
        "video": {"sampler": "fps", "fps": 1.0, "ops": _CROP224},
    },
    "clips": {
        "description": "video: 4 uniform 16-frame clips [4, 16, 224, 224, 3] uint8",
        "video": {"sampler": "clips", "clip_length": 16, "num_clips": 4, "stride": 1,
                  "ops": _CROP224},
    },
    "thumbnails": {
        "description": "images: [224, 224, 3] uint8 RGB (short side 224, center crop)",
        "image": {"ops": _CROP224},
    },
}

AUDIO_OPS = {
    "log_mel": None,  # preset + LogMelConfig fields (checked against the dataclass)
    "mel": {"n_fft", "win_length", "hop_length", "n_mels", "fmin", "fmax", "window", "center",
            "pad_mode", "power", "htk", "norm", "periodic"},
    "log": {"guard", "guard_value"},
    "power_to_db": {"ref", "amin", "top_db", "multiplier"},
    "mfcc": {"n_mfcc", "norm"},
    "normalize": {"mode", "eps", "ddof"},
    "stack_frames": {"stacking", "subsampling"},
}
FEATURE_OPS = {"log_mel", "mel"}
PIXEL_OPS = {
    "resize": {"short_side", "size", "interpolation", "antialias"},
    "center_crop": {"size"},
}
SAMPLERS = {
    "uniform": {"num_frames"},
    "fps": {"fps", "max_frames"},
    "clips": {"clip_length", "num_clips", "stride"},
}


class PresetError(ValueError):
    pass


def _check_ops(kind, ops, table, where):
    if not isinstance(ops, list) or not ops:
        raise PresetError(f"{where}: [{kind}] needs a non-empty list 'ops'")
    out = []
    for i, op in enumerate(ops):
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise PresetError(f"{where}: [{kind}] ops[{i}] must be a table with an 'op' name")
        name = op["op"]
        if name not in table:
            raise PresetError(
                f"{where}: [{kind}] ops[{i}]: unknown operator {name!r}; "
                f"one of {', '.join(sorted(table))}"
            )
        args = {k: v for k, v in op.items() if k != "op"}
        allowed = table[name]
        if name == "log_mel":
            allowed = {f.name for f in fields(audio_ops.LogMelConfig)} - {"name"} | {"preset"}
        extra = set(args) - allowed
        if extra:
            raise PresetError(
                f"{where}: [{kind}] ops[{i}] ({name}): unknown argument(s) {sorted(extra)}; "
                f"it takes {sorted(allowed)}"
            )
        out.append({"op": name, **args})
    return out


def normalize_preset(cfg: dict, *, name: str, where: str = "preset") -> dict:
    """Check a preset dict and return it in its full form (defaults filled in)."""
    if not isinstance(cfg, dict):
        raise PresetError(f"{where}: a preset must be a table")
    known = {"name", "description", "batch_size", *KINDS}
    extra = set(cfg) - known
    if extra:
        raise PresetError(f"{where}: unknown key(s) {sorted(extra)}; a preset has {sorted(known)}")
    out: dict = {"name": str(cfg.get("name", name)),
                 "description": str(cfg.get("description", ""))}
    bs = cfg.get("batch_size", DEFAULT_BATCH_SIZE)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
        raise PresetError(f"{where}: batch_size must be a positive int, got {bs!r}")
    out["batch_size"] = bs
    if not any(k in cfg for k in KINDS):
        raise PresetError(f"{where}: a preset needs at least one of [audio], [video], [image]")
    if "audio" in cfg:
        a = dict(cfg["audio"])
        sr = a.pop("sample_rate", 16000)
        if isinstance(sr, bool) or not isinstance(sr, int) or sr <= 0:
            raise PresetError(f"{where}: [audio] sample_rate must be a positive int, got {sr!r}")
        dtype = a.pop("dtype", "float32")
        if dtype not in AUDIO_DTYPES:
            raise PresetError(f"{where}: [audio] dtype must be one of "
                              f"{', '.join(AUDIO_DTYPES)}, got {dtype!r}")
        ops = _check_ops("audio", a.pop("ops", None), AUDIO_OPS, where)
        if a:
            raise PresetError(f"{where}: [audio] unknown key(s) {sorted(a)}")
        if ops[0]["op"] not in FEATURE_OPS:
            raise PresetError(f"{where}: [audio] the first operator must be one of "
                              f"{sorted(FEATURE_OPS)}, got {ops[0]['op']!r}")
        out["audio"] = {"sample_rate": sr, "ops": ops}
        if dtype != "float32":  # the default is not written (see the module docstring)
            out["audio"]["dtype"] = dtype
    if "video" in cfg:
        v = dict(cfg["video"])
        sampler = v.pop("sampler", "uniform")
        if sampler not in SAMPLERS:
            raise PresetError(f"{where}: [video] sampler must be one of {sorted(SAMPLERS)}, "
                              f"got {sampler!r}")
        defaults = {"uniform": {"num_frames": 8}, "fps": {"fps": 1.0, "max_frames": None},
                    "clips": {"clip_length": 16, "num_clips": 4, "stride": 1}}[sampler]
        s = {"sampler": sampler}
        for k, d in defaults.items():
            s[k] = v.pop(k, d)
        ops = _check_ops("video", v.pop("ops", None), PIXEL_OPS, where)
        if v:
            raise PresetError(f"{where}: [video] unknown key(s) {sorted(v)} for sampler "
                              f"{sampler!r} (it takes {sorted(SAMPLERS[sampler])})")
        if sampler == "fps" and not (isinstance(s["fps"], (int, float)) and s["fps"] > 0):
            raise PresetError(f"{where}: [video] fps must be a positive number, got {s['fps']!r}")
        out["video"] = {**s, "ops": ops}
    if "image" in cfg:
        im = dict(cfg["image"])
        ops = _check_ops("image", im.pop("ops", None), PIXEL_OPS, where)
        if im:
            raise PresetError(f"{where}: [image] unknown key(s) {sorted(im)}")
        out["image"] = {"ops": ops}
    _check_values(out, where)
    return out


def _bad(where, kind, i, op, e) -> PresetError:
    return PresetError(f"{where}: [{kind}] ops[{i}] ({op['op']}): {e}")


def _size(name, v):
    """An int or [h, w] of positive ints."""
    if isinstance(v, (list, tuple)) and len(v) == 2:
        for x in v:
            pos_int(name, x)
        return
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int or [height, width], got {v!r}")


def _check_values(cfg: dict, where: str) -> None:
    """Check the operators' values as a run would use them, so that a bad one fails when the
    preset is read (naming the operator, its argument and the value), before anything is
    written, instead of failing every input. The audio chain runs once on a short signal on
    the CPU (its operators check their own arguments); pixel operators and video samplers are
    checked here (a dry run would depend on the image size)."""
    if "audio" in cfg:
        a = cfg["audio"]
        ops = a["ops"]
        for i, op in enumerate(ops):
            if op["op"] == "log_mel" and op.get("preset", "nemo") not in audio_ops.PRESETS:
                raise _bad(where, "audio", i, op, f"preset must be one of "
                           f"{', '.join(audio_ops.PRESETS)}, got {op['preset']!r}")
        sr = a["sample_rate"]
        n = sr  # 1 s, or longer for the windows the preset names
        for op in ops:
            for k in ("n_fft", "win_length"):
                v = op.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    n = max(n, 4 * v)

        def run(chain):
            x = np.zeros((1, n), dtype=np.float32)
            x[0, ::97] = 0.25  # not all zeros: some operators branch on silence
            apply_audio_ops(x, np.array([n], dtype=np.int64), sr, chain)

        try:
            run(ops)
        except Exception:  # noqa: BLE001 - find the operator that fails, and say why
            for i in range(len(ops)):
                try:
                    run(ops[: i + 1])
                except Exception as e:  # noqa: BLE001
                    raise _bad(where, "audio", i, ops[i], e) from None
    for kind in ("video", "image"):
        if kind not in cfg:
            continue
        for i, op in enumerate(cfg[kind]["ops"]):
            try:
                if op["op"] == "resize":
                    if ("size" in op) == ("short_side" in op):
                        raise ValueError("give exactly one of size or short_side")
                    if "size" in op:
                        _size("size", op["size"])
                    else:
                        pos_int("short_side", op["short_side"])
                    check_choice("interpolation", op.get("interpolation", "bilinear"),
                                 image_ops.INTERPOLATIONS)  # the resize's own filters
                    if not isinstance(op.get("antialias", True), bool):
                        raise ValueError(f"antialias must be true or false, "
                                         f"got {op['antialias']!r}")
                elif op["op"] == "center_crop":
                    if "size" not in op:
                        raise ValueError("size is required")
                    _size("size", op["size"])
            except ValueError as e:
                raise _bad(where, kind, i, op, e) from None
    if "video" in cfg:
        v = cfg["video"]
        try:
            for k in ("num_frames", "clip_length", "num_clips", "stride"):
                if k in v:
                    pos_int(k, v[k])
            m = v.get("max_frames")
            if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
                raise ValueError(f"max_frames must be an int >= 0 (0: no limit), got {m!r}")
        except ValueError as e:
            raise PresetError(f"{where}: [video] {e}") from None


def load_preset_file(path: str) -> dict:
    """A preset from a TOML file (its name: the file's stem unless it sets ``name``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    with open(path, "rb") as f:
        try:
            cfg = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise PresetError(f"{path}: not valid TOML ({e})") from None
    name = os.path.splitext(os.path.basename(path))[0]
    return normalize_preset(cfg, name=name, where=path)


def resolve_preset(preset, *, fps: float | None = None, dtype: str | None = None) -> dict:
    """A built-in name, a path to a ``.toml`` file, or a dict -> the full preset dict.
    ``fps`` overrides the video sampler's rate (the ``frames`` preset's ``--fps``), ``dtype``
    the audio features' type (``--dtype``: float32 or float16)."""
    if isinstance(preset, dict):
        cfg = normalize_preset(copy.deepcopy(preset), name=preset.get("name", "custom"))
    elif isinstance(preset, str) and preset in BUILTIN:
        cfg = normalize_preset(copy.deepcopy(BUILTIN[preset]), name=preset)
    elif isinstance(preset, (str, os.PathLike)) and (
        os.fspath(preset).endswith(".toml") or os.path.isfile(os.fspath(preset))
    ):
        if not os.path.isfile(os.fspath(preset)):
            raise PresetError(f"preset file not found: {os.fspath(preset)!r}")
        cfg = load_preset_file(os.fspath(preset))
    else:
        raise PresetError(
            f"unknown preset {preset!r}; choose from {', '.join(BUILTIN)} or give a .toml file"
        )
    if fps is not None:
        v = cfg.get("video")
        if v is None or v["sampler"] != "fps":
            raise PresetError(f"--fps applies to presets that sample video at a rate "
                              f"(e.g. frames), not {cfg['name']!r}")
        if not (isinstance(fps, (int, float)) and fps > 0):
            raise PresetError(f"fps must be a positive number, got {fps!r}")
        v["fps"] = float(fps)
    if dtype is not None:
        if dtype not in AUDIO_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(AUDIO_DTYPES)}, got {dtype!r}")
        a = cfg.get("audio")
        if a is None:
            raise ValueError(f"dtype={dtype!r} applies to audio features; the preset "
                             f"{cfg['name']!r} has no [audio]")
        a.pop("dtype", None)
        if dtype != "float32":
            a["dtype"] = dtype
    return cfg


def extensions_of(cfg: dict) -> dict[str, str]:
    return {ext: kind for kind in KINDS if kind in cfg for ext in EXTENSIONS[kind]}


def describe_builtins() -> str:
    return "\n".join(f"{n}: {p['description']}" for n, p in BUILTIN.items())
