"""A transformers model (``hf:``) as the planner sees it: FLOPs and bytes per layer, from its config.

Counted as ``plan.types.ModelProfile.from_model_config`` counts the built-in transformer, per
sample of ``seq_len`` tokens: a matmul costs 2 FLOPs per weight per token forward, its backward
as much again for the input-grad (B) and for the weight-grad (W); attention's score products
(``QK^T`` and ``AV``, ``4 T`` FLOPs per token per query channel, causal mask not exploited) have no
weights, so their backward all goes to B; the embedding is a lookup (``T * D``) with no input-grad.
The weights counted are those of the layers as built (on the meta device: nothing allocated),
so grouped-query attention, gated MLPs and biases count as they are.
"""
from __future__ import annotations

from torch import nn

from ..plan import types as pt


def _matmul_weights(layer: nn.Module) -> int:
    from transformers.pytorch_utils import Conv1D

    return sum(m.weight.numel() for m in layer.modules() if isinstance(m, (nn.Linear, Conv1D)))


def hf_model_profile(hf, seq_len: int, wire_dtype_bytes: int = 4, stash_dtype_bytes: int = 2) -> pt.ModelProfile:
    """The profile of ``hf`` (a ``models.hf_model.HFModel``) for sequences of ``seq_len`` tokens."""
    c = hf.config
    t, d, v = seq_len, c.hidden_size, c.vocab_size
    q_channels = c.num_attention_heads * getattr(c, "head_dim", None) if getattr(c, "head_dim", None) else d
    layers = hf.meta_layers()
    act = float(t * d * wire_dtype_bytes)
    params = [4.0 * sum(p.numel() for p in layer.parameters()) for layer in layers]  # fp32 master weights
    out = [pt.LayerProfile(fwd_flops=float(t * d), bwd_input_flops=0.0, bwd_weight_flops=float(t * d),
                           param_bytes=params[0], activation_bytes_out=act)]
    attn = 4.0 * t * t * q_channels
    # under autocast (activations of fewer than 4 bytes) each micro-batch's forward keeps its own
    # low-precision copy of every matmul weight for the backward
    copy = float(stash_dtype_bytes) if stash_dtype_bytes < 4 else 0.0
    for layer, pb in zip(layers[1:-1], params[1:-1]):
        w = _matmul_weights(layer)
        mm = 2.0 * w * t
        out.append(pt.LayerProfile(fwd_flops=mm + attn, bwd_input_flops=mm + 2 * attn, bwd_weight_flops=mm,
                                   param_bytes=pb, activation_bytes_out=act,
                                   stash_bytes=17.0 * t * d * stash_dtype_bytes, stash_fixed_bytes=copy * w))
    w = _matmul_weights(layers[-1])
    head = 2.0 * w * t
    out.append(pt.LayerProfile(fwd_flops=head, bwd_input_flops=head, bwd_weight_flops=head, param_bytes=params[-1],
                               activation_bytes_out=0.0, stash_bytes=float(t * d * stash_dtype_bytes + t * v * 4),
                               stash_fixed_bytes=copy * w))
    n = sum(params) / 4
    return pt.ModelProfile(tuple(out), name=f"{hf.source.spec} ({c.model_type}, d={d}, L={c.num_hidden_layers}, "
                                            f"T={t}, V={v}, {n / 1e6:.1f}M params)",
                           wire_dtype_bytes=wire_dtype_bytes)
