"""KV cache codec: chunks of :class:`cachegen.kv.KVCache` to compact bytes and back.

Public API::

    from cachegen.codec import Codec, calibrate, LOSSLESS, LEVELS
    prof = calibrate(samples, model_fingerprint)     # once per model (or load_or_calibrate(model))
    codec = Codec(prof)
    data = codec.encode(kv_chunk, level=3)           # 1 = near-lossless ... 7 = most aggressive
    kv2 = codec.decode(data)
    codec.peek(data)                                 # ChunkHeader without decoding

``Codec(None)`` writes chunks that carry their own tables (no profile needed
to decode). Level 0 (:data:`LOSSLESS`) is bit-exact for fp16/bf16/fp32.
See ``docs/codec.md``.
"""

from cachegen.codec import rans
from cachegen.codec.codec import LOSSLESS, Codec
from cachegen.codec.container import FORMAT_VERSION, ChunkHeader, LayerShape
from cachegen.codec.protocol import ChunkCodec
from cachegen.codec.profile import KL_TARGETS, LEVELS, Profile, calibrate

__all__ = [
    "FORMAT_VERSION",
    "LOSSLESS",
    "LEVELS",
    "KL_TARGETS",
    "Profile",
    "Codec",
    "ChunkCodec",
    "ChunkHeader",
    "LayerShape",
    "calibrate",
    "rans",
    "calibrate_for_model",
    "load_or_calibrate",
    "profile_path",
]


def __getattr__(name: str):
    # model-facing helpers import torch-model code lazily
    if name in ("calibrate_for_model", "load_or_calibrate", "profile_path"):
        from cachegen.codec import model_profile

        return getattr(model_profile, name)
    raise AttributeError(name)
