"""KV cache codec: chunks of :class:`cachegen.kv.KVCache` to compact bytes and back.

Public API::

    from cachegen.codec import Codec, calibrate, LOSSLESS, LEVELS
    prof = calibrate(samples, model_fingerprint)     # once per model (from a live model: cachegen.calibrate)
    codec = Codec(prof)
    data = codec.encode(kv_chunk, level=3)           # 1 = near-lossless ... 7 = most aggressive
    kv2 = codec.decode(data)
    codec.peek(data)                                 # ChunkHeader without decoding

``Codec(None)`` writes chunks that carry their own tables (no profile needed
to decode). Level 0 (:data:`LOSSLESS`) is bit-exact for fp16/bf16/fp32.
Every codec of the project implements :class:`ChunkCodec`. Fitting a
profile to a live model (KV samples, Fisher sensitivities) is the layer
above, :mod:`cachegen.calibrate`. See ``docs/codec.md``.
"""

from cachegen.codec import rans
from cachegen.codec.codec import LOSSLESS, Codec
from cachegen.codec.container import FORMAT_VERSION, ChunkHeader, LayerShape
from cachegen.codec.fit import calibrate
from cachegen.codec.profile import KL_TARGETS, LEVELS, Profile
from cachegen.codec.protocol import ChunkCodec

__all__ = [
    "FORMAT_VERSION",
    "KL_TARGETS",
    "LEVELS",
    "LOSSLESS",
    "ChunkCodec",
    "ChunkHeader",
    "Codec",
    "LayerShape",
    "Profile",
    "calibrate",
    "rans",
]
