"""Every decoder / operator this recipe uses, imported in one place (lazily, on first use).

The rest of the package reaches them as ``_deps.AudioBatchLoader`` etc.; when a module moves,
only the paths below change.
"""

from __future__ import annotations

import importlib

_WHERE = {
    # batched audio decode: worker processes / the GPU FLAC decoder
    "AudioBatchLoader": "avpipe.pipeline.audio_loader",
    "load_audio": "avpipe.decoding.audio",
    "flac_header_info": "avpipe.decoding.audio._flac_cuda",
    "flac_compile_kernels": "avpipe.decoding.audio._flac_cuda",
    "VideoDecoder": "avpipe.decoding.video",
    "decode_image_stream": "avpipe.pipeline.image_stream",
    "decode_image_batch": "avpipe.decoding.image",
    "clip_indices_regular": "avpipe.pipeline.samplers",
    "uniform_indices": "avpipe.pipeline.samplers",
    "audio_ops": "avpipe.ops.audio",
    "image_ops": "avpipe.ops.image",
    "resolve_device": "avpipe.device",
    "to_numpy": "avpipe.device",
    "gpu_count": "avpipe.device",
}
_ATTR = {"audio_ops": None, "image_ops": None, "gpu_count": "_gpu_count",
         "flac_header_info": "header_info", "flac_compile_kernels": "compile_kernels"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(name)
    mod = importlib.import_module(_WHERE[name])
    attr = _ATTR.get(name, name)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value
