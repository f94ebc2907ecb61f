"""Compression of activations and gradients between pipeline stages.

- ``codecs``: the codecs (none, fp16, int8, int, top-k) as pure functions over tensors and bytes,
  and error feedback for gradients;
- ``adaptive``: the per-link choice of a codec (compress a link only as much as it needs).
"""
from .adaptive import (DEFAULT_CANDIDATES, DEFAULT_FLOORS, AdaptivePolicy, Option, choose, evaluate,
                       measure_fidelities, nominal_fidelity)
from .codecs import (CODECS, DEFAULT_MAX_BYTES, CodecError, ErrorFeedback, check_params, decode, encode,
                     fidelity, parse_spec, roundtrip, spec, topk_count, wire_bytes, wire_ratio)

__all__ = [
    "AdaptivePolicy", "CODECS", "CodecError", "DEFAULT_CANDIDATES", "DEFAULT_FLOORS", "DEFAULT_MAX_BYTES",
    "ErrorFeedback", "Option", "check_params", "choose", "decode", "encode", "evaluate", "fidelity",
    "measure_fidelities", "nominal_fidelity", "parse_spec", "roundtrip", "spec", "topk_count",
    "wire_bytes", "wire_ratio",
]
