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

Only the kinds present are extracted (their files are picked by extension). Operators are the
registry's (:mod:`avpipe.ops.registry`): ``[audio]`` takes the audio ones, ``[video]`` and
``[image]`` the image ones, each checked against its entry (arguments, their types and values);
a preset takes only operators that draw nothing at random (its bytes are the same on every
run), in an order where each takes what the one before gives: audio from the signal to
features (so the first that makes features, ``log_mel`` or ``mel``, comes first), pixels to
pixels for frames and images. :func:`describe_operators` lists them (``avpipe extract --help``).

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

import numpy as np

from ..._validate import pos_int  # noqa: E402
from ...formats import AUDIO_EXTENSIONS, IMAGE_EXTENSIONS, VIDEO_EXTENSIONS  # noqa: E402
from ...ops import registry
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

# what each kind's operators take (the registry's kind and stage) and must end with
OP_KIND = {"audio": "audio", "video": "image", "image": "image"}
OP_STAGES = {"audio": ("signal", "features"), "video": ("pixels", "pixels"),
             "image": ("pixels", "pixels")}
SAMPLERS = {
    "uniform": {"num_frames"},
    "fps": {"fps", "max_frames"},
    "clips": {"clip_length", "num_clips", "stride"},
}


class PresetError(ValueError):
    pass


def preset_ops(kind: str) -> list:
    """The registry's entries a preset's ``[kind]`` may name: of its kind, drawing nothing at
    random, taking and giving the kind's stages."""
    stages = OP_STAGES[kind]
    return [e for e in registry.entries(kind=OP_KIND[kind], random=False)
            if e.stage in stages and e.gives in stages]


def _makers(kind, have, want):
    return sorted(e.name for e in preset_ops(kind) if e.stage == have and e.gives == want)


def _check_ops(kind, ops, where):
    """Each operator table against its registry entry: a known name of the kind, arguments it
    takes (of their types, and the values its own checks accept), nothing drawn at random,
    each taking what the one before gives, the last giving the kind's output."""
    if not isinstance(ops, list) or not ops:
        raise PresetError(f"{where}: [{kind}] needs a non-empty list 'ops'")
    stage, end = OP_STAGES[kind]
    allowed = {e.name: e for e in preset_ops(kind)}
    out = []
    for i, op in enumerate(ops):
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise PresetError(f"{where}: [{kind}] ops[{i}] must be a table with an 'op' name")
        name = op["op"]
        entry = allowed.get(name)
        if entry is None:
            why = ""
            other = [e for e in registry.entries(kind=OP_KIND[kind]) if e.name == name]
            if other and other[0].random:
                why = " (an augmentation: it draws random parameters per item)"
            elif other:
                why = (f" (it takes {other[0].stage} and gives {other[0].gives}; [{kind}] "
                       f"operators go from {OP_STAGES[kind][0]} to {OP_STAGES[kind][1]})")
            raise PresetError(
                f"{where}: [{kind}] ops[{i}]: unknown operator {name!r}{why}; "
                f"one of {', '.join(sorted(allowed))}"
            )
        args = {k: v for k, v in op.items() if k != "op"}
        ctx = sorted(set(args) & set(entry.context))
        if ctx:
            raise _bad(where, kind, i, op, f"{', '.join(ctx)} is the preset's, not an argument"
                       + (" (set [audio] sample_rate)" if "sample_rate" in ctx else ""))
        try:
            entry.check(args, allow_context=False)
        except ValueError as e:
            raise _bad(where, kind, i, op, e) from None
        if entry.stage != stage:
            makers = _makers(kind, stage, entry.stage)
            fix = f": put one of {makers} before it" if makers else ""
            if i == 0:
                raise PresetError(f"{where}: [{kind}] the first operator must take "
                                  f"{registry.STAGES[stage]}; {name!r} takes {entry.stage}{fix}")
            raise PresetError(f"{where}: [{kind}] ops[{i}] ({name}) takes {entry.stage}, but the "
                              f"operators before it give {stage}{fix}")
        stage = entry.gives
        out.append({"op": name, **args})
    if stage != end:
        raise PresetError(f"{where}: [{kind}] the operators must end with {end}; they end with "
                          f"{stage} (add one of {_makers(kind, stage, end)})")
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
        ops = _check_ops("audio", a.pop("ops", None), where)
        if a:
            raise PresetError(f"{where}: [audio] unknown key(s) {sorted(a)}")
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
        ops = _check_ops("video", v.pop("ops", None), where)
        if v:
            raise PresetError(f"{where}: [video] unknown key(s) {sorted(v)} for sampler "
                              f"{sampler!r} (it takes {sorted(SAMPLERS[sampler])})")
        if sampler == "fps" and not (isinstance(s["fps"], (int, float)) and s["fps"] > 0):
            raise PresetError(f"{where}: [video] fps must be a positive number, got {s['fps']!r}")
        out["video"] = {**s, "ops": ops}
    if "image" in cfg:
        im = dict(cfg["image"])
        ops = _check_ops("image", im.pop("ops", None), where)
        if im:
            raise PresetError(f"{where}: [image] unknown key(s) {sorted(im)}")
        out["image"] = {"ops": ops}
    _check_values(out, where)
    return out


def _bad(where, kind, i, op, e) -> PresetError:
    return PresetError(f"{where}: [{kind}] ops[{i}] ({op['op']}): {e}")


def _check_values(cfg: dict, where: str) -> None:
    """Check the operators' values as a run would use them, so that a bad one fails when the
    preset is read (naming the operator, its argument and the value), before anything is
    written, instead of failing every input. Each operator's registry entry has checked its
    arguments (:func:`_check_ops`); the audio chain also runs once on a short signal on the
    CPU (its operators check their own values; a pixel operator's dry run would depend on the
    image size). The video samplers are checked here."""
    if "audio" in cfg:
        a = cfg["audio"]
        ops = a["ops"]
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


def describe_operators(width: int = 88) -> str:
    """The operators a preset may name, from the registry, by kind: ``name(arguments)``, each
    wrapped to ``width`` columns."""
    import textwrap

    lines = []
    for kind, label in (("audio", "[audio]"), ("image", "[video] and [image]")):
        lines.append(f"{label} operators:")
        for e in preset_ops(kind):
            lines += textwrap.wrap(e.signature(allow_context=False), width, initial_indent="  ",
                                   subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


def describe_builtins() -> str:
    return "\n".join(f"{n}: {p['description']}" for n, p in BUILTIN.items())
