"""Log-mel presets: plain, documented configurations, each pinned to its reference's source.

A preset is a frozen :class:`LogMelConfig`; :func:`avpipe.ops.log_mel` runs it. Every number
here is the reference's; the docstrings cite the file and commit it was read from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LogMelConfig:
    """Every knob of :func:`avpipe.ops.log_mel` (see its docstring for the order of steps).

    ``frame_rule``: how many frames of an ``n``-sample item are valid —
    ``"floor_plus_one"``: ``n // hop + 1`` (centred STFT frames); ``"ceil"``: ``ceil(n / hop)``;
    ``"floor"``: ``n // hop``.
    """

    name: str
    sample_rate: int = 16000
    dither: float = 1e-5            # standard deviation, applied only when training=True
    preemph: float | None = 0.97
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    window: str = "hann"
    periodic: bool = False          # False: symmetric window (torch periodic=False)
    center: bool = True
    pad_mode: str = "constant"
    power: float = 2.0
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = None       # None: sample_rate / 2
    mel_htk: bool = False
    mel_norm: str | None = "slaney"
    log_guard: str = "add"          # "add": ln(x + v); "clamp": ln(max(x, v))
    log_guard_value: float = 2.0 ** -24
    normalize: str | None = "per_feature"
    norm_eps: float = 1e-5
    norm_ddof: int = 1
    frame_rule: str = "floor_plus_one"
    pad_to: int = 0

    def replace(self, **changes) -> LogMelConfig:
        return replace(self, **changes)


NEMO = LogMelConfig(
    name="nemo",
    sample_rate=16000, dither=1e-5, preemph=0.97,
    n_fft=512, win_length=400, hop_length=160, window="hann", periodic=False,
    center=True, pad_mode="constant", power=2.0,
    n_mels=80, fmin=0.0, fmax=8000.0, mel_htk=False, mel_norm="slaney",
    log_guard="add", log_guard_value=2.0 ** -24,
    normalize="per_feature", norm_eps=1e-5, norm_ddof=1,
    frame_rule="floor", pad_to=0,
)
NEMO_DOC = """Current NeMo's (2.x) ``FilterbankFeatures`` as configured for Conformer / FastConformer
Transducers and Parakeet (16 kHz): what a current checkpoint was trained on.

Source: NVIDIA NeMo, ``nemo/collections/asr/parts/preprocessing/features.py``
(``FilterbankFeatures.get_seq_len``, ``FilterbankFeatures.forward``, ``normalize_batch``), read at
NVIDIA-NeMo/NeMo commit 009d1c153f0652d2558897c7e3e4670dfd6a7437: zero-padded centred
``torch.stft`` (``pad_mode="constant"``), preemphasis masked to the item's length, and the frame
count ``get_seq_len = floor_divide(n + pad_amount - n_fft, hop)`` with
``pad_amount = n_fft // 2 * 2``, that is ``n // 160``; the per-feature statistics are taken over
those frames only, and every frame from ``n // 160`` on (the STFT's last frame included) is set
to the pad value 0. The Conformer-Transducer configs set ``window_size 0.025,
window_stride 0.01, features 80, n_fft 512, dither 1e-5, pad_to 0``.

Steps: dither 1e-5 (training only) -> preemphasis 0.97 (y[0] = x[0], zero past the length)
-> STFT: symmetric Hann of 400 samples centred in n_fft 512, hop 160, centred frames with zero
padding -> |X|^2 -> 80 Slaney-scale, Slaney-normalized mel filters 0-8 kHz (librosa) ->
ln(x + 2^-24) -> per-feature normalization over the valid frames, (x - mean) / (std + 1e-5)
with the n-1 std -> frames past the length set to 0; pad_to 0. Valid frames per item:
``n // 160`` (an item under 160 samples has none; one with a single valid frame normalizes to
0, as NeMo's NaN-to-0 std guard gives). NeMo 1.x counted one frame more: ``"nemo_v1"``.
"""

NEMO_V1 = NEMO.replace(name="nemo_v1", frame_rule="floor_plus_one")
NEMO_V1_DOC = """NeMo 1.x's ``FilterbankFeatures``: the ``nemo`` preset with one more valid frame.

Source: NVIDIA/NeMo commit bcb749ef88e0d8169e42180fe54ac7b425537d20,
``nemo/collections/asr/parts/preprocessing/features.py`` (``get_seq_len``:
``floor((n + 2 * (n_fft // 2) - n_fft) / hop) + 1 = n // 160 + 1``). Every other step is the
``nemo`` preset's; the STFT's last centred frame counts as valid and enters the statistics.
Use it for checkpoints trained with NeMo 1.x.
"""

MLPERF_RNNT = LogMelConfig(
    name="mlperf_rnnt",
    sample_rate=16000, dither=1e-5, preemph=0.97,
    n_fft=512, win_length=320, hop_length=160, window="hann", periodic=False,
    center=True, pad_mode="reflect", power=2.0,
    n_mels=80, fmin=0.0, fmax=8000.0, mel_htk=False, mel_norm="slaney",
    log_guard="add", log_guard_value=1e-20,
    normalize="per_feature", norm_eps=1e-5, norm_ddof=1,
    frame_rule="ceil", pad_to=0,
)
MLPERF_RNNT_DOC = """The MLPerf training RNN-T reference's features.

Source: mlcommons/training, ``rnn_speech_recognition/pytorch/common/data/features.py``
(``FilterbankFeatures``, ``normalize_batch``, ``stack_subsample_frames``) at commit
3c1db881a599bf94cd82373ac674faf06ab9fc0a, with the values of
``rnn_speech_recognition/pytorch/configs/baseline_v3-1023sp.yaml`` at commit
1bb9419234c6efc9031143ac72616845a4888517 (window_size 0.02, window_stride 0.01, hann, n_fft 512,
n_filt 80, dither 1e-5, normalize per_feature, frame_stacking 3, frame_subsampling 3).

Steps: dither 1e-5 (training only) -> preemphasis 0.97 -> STFT: symmetric Hann of
``int(16000 * 0.02) = 320`` samples centred in n_fft 512, hop 160, centred frames with reflect
padding (``torch.stft``'s default) -> |X|^2 -> 80 Slaney mel filters 0-8 kHz (librosa defaults)
-> ln(x + 1e-20) -> per-feature normalization over the valid frames ((x - mean) / (std + 1e-5),
n-1 std) -> frames past the length set to 0 (its ``FillPadding``). Valid frames per item:
``ceil(n / 160)``. Frame stacking / subsampling (3 and 3, ``ceil(frames / 3)``) is the separate
:func:`avpipe.ops.stack_frames` applied after ``log_mel``.

Differences from running the reference on a padded batch, by design: each item is processed as
if alone (the reflection happens at the item's own end, and its preemphasis stops at its end),
so an item's features do not depend on what it is batched with.
"""

PRESETS = {"nemo": NEMO, "nemo_v1": NEMO_V1, "mlperf_rnnt": MLPERF_RNNT}
PRESET_DOCS = {"nemo": NEMO_DOC, "nemo_v1": NEMO_V1_DOC, "mlperf_rnnt": MLPERF_RNNT_DOC}
