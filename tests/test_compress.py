"""Compression codecs, error feedback and the per-link adaptive choice: pure functions, no network."""
import math
import random

import numpy as np
import pytest
import torch

from spantrain_p2p.compress import (AdaptivePolicy, CodecError, ErrorFeedback, choose, decode, encode, evaluate,
                                    fidelity, measure_fidelities, nominal_fidelity, parse_spec, roundtrip, spec,
                                    topk_count, wire_bytes, wire_ratio)
from spantrain_p2p.compress.adaptive import plannable
from spantrain_p2p.plan.types import compression_ratio

SHAPE = (8, 128, 256)  # an activation: micro-batch × sequence × hidden
MBIT = 1e6 / 8  # bytes/s in one Mbit/s


def gaussian(shape=SHAPE, seed=0, scale=1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def wire(meta, bufs):
    """What the receiver gets: plain bytes, as after a trip through the network."""
    return dict(meta), [bytes(b) for b in bufs]


# ---- round trips ----------------------------------------------------------------------------------

def test_none_round_trip_is_exact():
    x = gaussian()
    meta, bufs = wire(*encode("none", x))
    assert meta == {"codec": "none"}
    y = decode(meta, bufs, SHAPE)
    assert y.dtype == torch.float32 and y.shape == x.shape and torch.equal(x, y)


def test_fp16_round_trip_within_1e3_relative():
    x = gaussian(scale=30.0)
    y = decode(*wire(*encode("fp16", x)), SHAPE)
    assert rel_l2(y, x) < 1e-3
    assert float(((y - x).abs() / x.abs().clamp_min(1e-3)).max()) < 1e-3  # elementwise too


def test_int8_round_trip_within_1pct_on_gaussian_activations():
    x = gaussian(scale=5.0)
    meta, bufs = wire(*encode("int8", x))
    assert meta == {"codec": "int8", "block": 256}
    assert rel_l2(decode(meta, bufs, SHAPE), x) < 0.01


@pytest.mark.parametrize("bits,error", [(7, 0.016), (6, 0.032), (5, 0.065), (4, 0.14), (2, 0.9)])
def test_int_packs_fewer_bits_per_value_with_the_error_its_bits_allow(bits, error):
    x = gaussian(seed=3)
    meta, bufs = wire(*encode("int", x, bits=bits))
    assert meta == {"codec": "int", "bits": bits, "block": 256}
    n = x.numel()
    assert [len(b) for b in bufs] == [-(-n * bits // 8), 4 * (n // 256)] == [
        wire_bytes("int", SHAPE, bits=bits) - 4 * (n // 256), 4 * (n // 256)]
    assert rel_l2(decode(meta, bufs, SHAPE), x) < error


def test_int_of_an_odd_length_pads_its_last_byte_and_keeps_zeros_and_extremes():
    x = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.25, 0.0, 0.0])  # 7 x 6 bits = 42 bits in 6 bytes
    meta, bufs = wire(*encode("int:6", x))
    assert len(bufs[0]) == 6
    y = decode(meta, bufs, (7,))
    assert y[0] == 0 and y[1] == 1.0 and y[2] == -1.0 and float((y - x).abs().max()) <= 1 / 31 / 2 + 1e-7


def test_int8_outlier_coarsens_only_its_own_block_and_zero_blocks_stay_zero():
    x = gaussian((4, 1000), seed=1)  # 4000 values: the last block is short
    x[0, 3] = 1e4
    x[3, 500:] = 0.0
    y = roundtrip("int8", x)
    assert rel_l2(y.view(-1)[256:], x.view(-1)[256:]) < 0.01  # the other blocks keep their precision
    assert torch.equal(y[3, 512:], torch.zeros(488))
    assert float(y[0, 3]) == pytest.approx(1e4, rel=1e-6)


@pytest.mark.parametrize("values", ["fp32", "fp16"])
def test_topk_keeps_exactly_k_of_the_largest_magnitudes(values):
    x = gaussian(seed=2)
    n = x.numel()
    meta, bufs = wire(*encode("topk", x, ratio=0.05, values=values))
    k = topk_count(n, 0.05)
    assert meta == {"codec": "topk", "k": k, "values": values} and k == round(0.05 * n)
    y = decode(meta, bufs, SHAPE)
    kept = y.view(-1) != 0
    assert int(kept.sum()) == k
    threshold = float(x.abs().view(-1).kthvalue(n - k + 1).values)
    assert torch.equal(kept, x.abs().view(-1) >= threshold)
    if values == "fp32":
        assert torch.equal(y.view(-1)[kept], x.view(-1)[kept])
    else:
        assert rel_l2(y.view(-1)[kept], x.view(-1)[kept]) < 1e-3


def test_topk_fp16_values_keep_tiny_gradients_that_plain_fp16_would_flush():
    g = gaussian((4096,), seed=3, scale=1e-9)  # below fp16's smallest subnormal (6e-8)
    y = roundtrip("topk", g, ratio=0.1)
    kept = y != 0
    assert int(kept.sum()) == 410
    assert rel_l2(y[kept], g[kept]) < 1e-3
    assert float(roundtrip("fp16", g).abs().max()) == 0.0


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "topk"])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 0, 2), (257,)])
def test_empty_and_tiny_tensors_round_trip(name, shape):
    x = gaussian(shape, seed=4)
    meta, bufs = encode(name, x)
    assert sum(memoryview(b).nbytes for b in bufs) == wire_bytes(name, shape)
    y = decode(*wire(meta, bufs), shape)
    assert y.shape == x.shape
    if x.numel():
        assert float(y.abs().max()) > 0  # the largest value always survives


def test_encode_accepts_fp16_and_noncontiguous_tensors():
    x = gaussian((64, 32), seed=5)
    assert torch.equal(roundtrip("none", x.t()), x.t().contiguous())
    assert torch.equal(roundtrip("none", x.half()), x.half().float())


def test_encode_refuses_nan_inf_and_fp16_overflow():
    x = gaussian((100,))
    x[7] = float("nan")
    with pytest.raises(CodecError, match="NaN or infinite"):
        encode("int8", x)
    with pytest.raises(CodecError, match="beyond fp16's range"):
        encode("fp16", torch.tensor([1e5, 1.0]))
    with pytest.raises(CodecError, match="floating-point"):
        encode("none", torch.arange(4))


# ---- error feedback -------------------------------------------------------------------------------

def grad_stream(steps, n=4096, seed=6):
    """Gradients with a steady direction plus twice as much noise, like SGD's."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=gen) * 0.5
    return [mean + torch.randn(n, generator=gen) for _ in range(steps)]


def test_error_feedback_sum_of_decoded_topk_approaches_sum_of_true_gradients():
    grads = grad_stream(300)
    ef = ErrorFeedback()
    sent_ef, sent_plain, residual_norms = torch.zeros(4096), torch.zeros(4096), []
    for g in grads:
        meta, bufs = ef.encode(("link0", 0), "topk:0.05", g)
        sent_ef += decode(*wire(meta, bufs), (4096,))
        sent_plain += roundtrip("topk", g, ratio=0.05)
        residual_norms.append(float(torch.linalg.vector_norm(ef.residual(("link0", 0)))))
    true = torch.stack(grads).sum(0)
    # what was sent plus what is still pending is exactly what was computed
    assert torch.allclose(sent_ef + ef.residual(("link0", 0)), true, rtol=1e-4, atol=1e-3)
    assert rel_l2(sent_ef, true) < 0.1
    assert rel_l2(sent_plain, true) > 0.5  # without error feedback most of the signal never arrives
    g_norm = float(torch.linalg.vector_norm(grads[0]))
    assert max(residual_norms) < 10 * g_norm  # the residual stays bounded ...
    assert max(residual_norms[150:]) < 1.3 * max(residual_norms[:150])  # ... and does not grow


def test_error_feedback_slots_are_independent_and_the_gradient_is_not_modified():
    ef = ErrorFeedback()
    g = gaussian((1000,), seed=7)
    before = g.clone()
    ef.encode(("a", 0), "topk", g, ratio=0.01)
    ef.encode(("a", 1), "int8", g * 2)
    ef.encode(("b", 0), "none", g)
    assert torch.equal(g, before)
    assert len(ef) == 2 and ef.residual(("b", 0)) is None  # lossless: nothing pending
    assert float(ef.residual(("a", 0)).abs().max()) > float(ef.residual(("a", 1)).abs().max())


def test_error_feedback_drops_the_residual_when_the_shape_changes():
    ef = ErrorFeedback()
    ef.encode("s", "topk:0.1", gaussian((8, 64), seed=8))
    meta, bufs = ef.encode("s", "topk:0.1", (g := gaussian((6, 64), seed=9)))  # a short last micro-batch
    assert ef.resets == 1
    assert torch.equal(decode(meta, bufs, (6, 64)), roundtrip("topk", g, ratio=0.1))
    assert ef.residual("s").shape == (6, 64)


def test_error_feedback_keeps_at_most_max_slots_dropping_the_least_recent():
    ef = ErrorFeedback(max_slots=2)
    for slot in ("a", "b", "a", "c"):
        ef.encode(slot, "topk:0.1", gaussian((100,)))
    assert ef.residual("b") is None and ef.residual("a") is not None and ef.residual("c") is not None
    assert ef.residual_bytes == 2 * 100 * 4


# ---- hostile input --------------------------------------------------------------------------------

def _topk_msg(n=1000, k=10):
    meta, bufs = encode("topk", gaussian((n,)), ratio=k / n)
    return dict(meta), [bytearray(b) for b in bufs]


def _int8_msg(n=1000):
    meta, bufs = encode("int8", gaussian((n,)))
    return dict(meta), [bytearray(b) for b in bufs]


def _with_indices(idx):
    meta, bufs = _topk_msg()
    bufs[0] = bytearray(np.asarray(idx, dtype="<i4").tobytes())
    return meta, bufs


def _set(buf: bytearray, dtype: str, pos: int, value) -> bytearray:
    arr = np.frombuffer(buf, dtype=dtype).copy()
    arr[pos] = value
    return bytearray(arr.tobytes())


def _hostile_cases():
    n = 1000
    ok_idx = np.sort(np.random.default_rng(0).choice(n, 10, replace=False))
    m, b = _int8_msg()
    yield "unknown codec", {"codec": "zstd"}, b, (n,), "unknown codec 'zstd'"
    yield "meta not a map", ["none"], b, (n,), "must be a map"
    yield "extra meta field", {"codec": "none", "k": 3}, b, (n,), "unexpected field 'k'"
    yield "missing meta field", {"codec": "int8"}, b, (n,), "lacks field 'block'"
    yield "absurd int8 block", {**m, "block": 3}, b, (n,), "int8 block"
    yield "bool as int8 block", {**m, "block": True}, b, (n,), "int8 block"
    yield "too few buffers", m, b[:1], (n,), "carries 2 buffer"
    yield "short int8 values", m, [b[0][:-1], b[1]], (n,), r"buffer 0 is 999 bytes.*needs 1000"
    yield "long int8 scales", m, [b[0], b[1] + b"\0\0\0\0"], (n,), "buffer 1 is 20 bytes"
    yield "NaN int8 scale", m, [b[0], _set(b[1], "<f4", 1, np.nan)], (n,), "int8 scales holds NaN"
    yield "negative int8 scale", m, [b[0], _set(b[1], "<f4", 0, -1.0)], (n,), "int8 scales must lie"
    yield "huge int8 scale", m, [b[0], _set(b[1], "<f4", 0, 3e38)], (n,), "int8 scales must lie"
    yield "int8 -128", m, [_set(b[0], "i1", 5, -128), b[1]], (n,), "-127..127"
    m, b = encode("int:6", gaussian((n,)))
    m, b = dict(m), [bytearray(x) for x in b]
    yield "int bits out of range", {**m, "bits": 8}, b, (n,), "int bits must be an int in 2..7"
    yield "int missing bits", {"codec": "int", "block": 256}, b, (n,), "lacks field 'bits'"
    yield "short int values", m, [b[0][:-1], b[1]], (n,), r"buffer 0 is 749 bytes.*needs 750"
    yield "int value past its levels", m, [bytearray(b"\xff") + b[0][1:], b[1]], (n,), r"must lie in 0\.\.62"
    yield "NaN int scale", m, [b[0], _set(b[1], "<f4", 0, np.nan)], (n,), "int scales holds NaN"
    m7, b7 = encode("int:6", gaussian((7,)))
    yield "int padding bits set", dict(m7), [bytearray(b7[0][:-1]) + b"\x03", b7[1]], (7,), "padding bits"
    m, b = _topk_msg()
    yield "absurd k", {**m, "k": 900}, b, (n,), r"k=900 out of range 1\.\.500"
    yield "zero k", {**m, "k": 0}, b, (n,), "k=0 out of range"
    yield "float k", {**m, "k": 10.0}, b, (n,), "k=10.0 out of range"
    yield "unknown value dtype", {**m, "values": "bf16"}, b, (n,), "topk values must be one of"
    yield "index past the end", *_with_indices([*ok_idx[:-1], n]), (n,), r"index out of range 0\.\.999"
    yield "negative index", *_with_indices([-1, *ok_idx[1:]]), (n,), "index out of range"
    yield "duplicate index", *_with_indices([*ok_idx[:-1], ok_idx[-2]]), (n,), "duplicate"
    yield "unsorted indices", *_with_indices(ok_idx[::-1]), (n,), "strictly increasing"
    yield "NaN topk scale", m, [b[0], b[1], _set(b[2], "<f4", 0, np.nan)], (n,), "topk scale holds NaN"
    yield "inf topk value", m, [b[0], _set(b[1], "<f2", 2, np.inf), b[2]], (n,), "topk values holds NaN or inf"
    yield "topk value over 1", m, [b[0], _set(b[1], "<f2", 2, 7.0), b[2]], (n,), "must lie in -1..1"
    nan_f32 = bytearray(np.full(n, np.nan, "<f4").tobytes())
    yield "NaN in none", {"codec": "none"}, [nan_f32], (n,), "tensor holds NaN"
    inf_f16 = bytearray(np.full(n, np.inf, "<f2").tobytes())
    yield "inf in fp16", {"codec": "fp16"}, [inf_f16], (n,), "fp16 tensor holds NaN or inf"
    yield "shape over the limit", {"codec": "none"}, [b""], (1 << 20, 1 << 20), "over the .*-byte limit"
    yield "negative dim", {"codec": "none"}, [b""], (-4,), "non-negative ints"
    yield "too many dims", {"codec": "none"}, [b""], (1,) * 9, "at most 8"
    yield "a string buffer", {"codec": "none"}, ["abcd"], (1,), "buffer 0 is a str"
    yield "buffers not a list", {"codec": "none"}, b"abcd", (1,), "buffers must be a list"


@pytest.mark.parametrize("meta,bufs,shape,error", [c[1:] for c in _hostile_cases()],
                         ids=[c[0] for c in _hostile_cases()])
def test_decode_rejects_hostile_input_with_a_clear_error(meta, bufs, shape, error):
    with pytest.raises(CodecError, match=error):
        decode(meta, bufs, shape)


def test_decode_rejects_too_many_bytes_before_reading_them():
    meta, bufs = wire(*encode("none", gaussian((1024,))))
    with pytest.raises(CodecError, match="over the 1000-byte limit"):
        decode(meta, bufs, (1024,), max_bytes=1000)
    with pytest.raises(CodecError, match="4100 bytes of buffers, over the 4096-byte limit"):
        decode(meta, [bufs[0] + bytes(4)], (1024,), max_bytes=4096)
    with pytest.raises(CodecError, match="buffer 0 is 4100 bytes"):
        decode(meta, [bufs[0] + bytes(4)], (1024,))


def test_decode_accepts_only_the_allowed_codecs():
    meta, bufs = encode("fp16", gaussian((10,)))
    with pytest.raises(CodecError, match="not accepted here"):
        decode(meta, bufs, (10,), allowed={"none", "int8"})
    assert decode(meta, bufs, (10,), allowed={"fp16"}).shape == (10,)


@pytest.mark.parametrize("params,error", [
    ({"ratio": 0.0}, "topk ratio"), ({"ratio": 0.9}, "topk ratio"), ({"ratio": 5}, "topk ratio"),
    ({"ratio": float("nan")}, "topk ratio"), ({"ratio": True}, "topk ratio"), ({"ratio": "0.1"}, "topk ratio"),
    ({"values": "int4"}, "topk values"), ({"block": 256}, "no parameter 'block'"),
])
def test_encode_rejects_absurd_parameters(params, error):
    with pytest.raises(CodecError, match=error):
        encode("topk", gaussian((100,)), **params)


def test_specs_parse_and_print_as_plans_spell_them():
    assert parse_spec("topk:0.05") == ("topk", {"ratio": 0.05, "values": "fp16"})
    assert parse_spec("int8") == ("int8", {"block": 256})
    assert parse_spec("int:5:64") == ("int", {"bits": 5, "block": 64})
    for s in ("none", "fp16", "int8", "int8:64", "int:6", "int:4:64", "topk:0.1", "topk:0.01:fp32"):
        assert spec(*parse_spec(s)) == s
    for bad in ("topk:x", "int8:1:2", "gzip", "none:1", "int:8", "int:1", "int:6:64:1"):
        with pytest.raises(CodecError):
            parse_spec(bad)


# ---- wire ratios and fidelity -----------------------------------------------------------------------

def test_wire_ratios_match_the_bytes_actually_produced():
    assert wire_ratio("none", SHAPE) == 1.0
    assert wire_ratio("fp16", SHAPE) == 0.5
    assert wire_ratio("int8", SHAPE) == pytest.approx(0.25 + 1 / 256)
    assert wire_ratio("topk", SHAPE, ratio=0.1) == pytest.approx(0.1 * (4 + 2) / 4, rel=1e-3)
    assert wire_ratio("topk:0.1:fp32", SHAPE) == pytest.approx(0.1 * (4 + 4) / 4, rel=1e-3)
    x = gaussian((3, 333), seed=10)
    for s in ("none", "fp16", "int8", "int8:64", "topk:0.01", "topk:0.5", "topk:0.2:fp32"):
        _, bufs = encode(s, x)
        assert sum(memoryview(b).nbytes for b in bufs) == wire_bytes(s, x.shape), s


def test_fidelity_on_gaussian_matches_the_nominal_model():
    x = gaussian(seed=11)
    for s, at_least in (("none", 1.0), ("fp16", 0.999), ("int8", 0.99), ("topk:0.5", 0.7), ("topk:0.05", 0.1)):
        name, params = parse_spec(s)
        f = fidelity(name, x, **params)
        assert f >= at_least, s
        assert f == pytest.approx(nominal_fidelity(name, **params), abs=0.005), s
    assert fidelity("topk", torch.zeros(10), ratio=0.1) == 1.0


# ---- adaptive choice --------------------------------------------------------------------------------

RAW = math.prod(SHAPE) * 4  # 1 MiB of float32 activations


def test_adaptive_sends_uncompressed_on_a_fast_link():
    assert choose(10_000 * MBIT, 0.001, RAW, 0.05, "act") == ("none", {})
    assert choose(10_000 * MBIT, 0.001, RAW, 0.05, "grad") == ("none", {})


def test_adaptive_picks_int8_for_activations_and_topk_for_gradients_on_a_10mbit_link():
    # 1 MiB at 10 Mbit/s: none 0.86 s, fp16 0.44 s, int8 0.23 s, topk:0.05 0.08 s (with 20 ms RTT/2)
    assert choose(10 * MBIT, 0.04, RAW, 0.3, "act") == ("int8", {"block": 256})
    assert choose(10 * MBIT, 0.04, RAW, 0.1, "grad") == ("topk", {"ratio": 0.05, "values": "fp16"})
    assert choose(10 * MBIT, 0.04, RAW, 0.6, "act") == ("fp16", {})


def test_adaptive_respects_the_fidelity_floor():
    # nothing hides behind 10 ms: the fastest transfer that still meets the floor
    # 6-bit blocks keep 0.97 of gaussian activations; 4 bits (0.87) and top-k are under 0.95
    assert choose(10 * MBIT, 0.04, RAW, 0.01, "act") == ("int", {"bits": 6, "block": 256})
    assert choose(10 * MBIT, 0.04, RAW, 0.01, "act", fidelity_floor=0.98)[0] == "int8"
    assert choose(10 * MBIT, 0.04, RAW, 0.01, "act", fidelity_floor=0.999)[0] == "fp16"
    assert choose(10 * MBIT, 0.04, RAW, 0.01, "grad") == ("topk", {"ratio": 0.01, "values": "fp16"})
    # a floor of 0.2 rules out top-k 1 % and 5 %; 4-bit blocks (0.129 of fp32) beat top-k 10 % (0.15)
    assert choose(10 * MBIT, 0.04, RAW, 0.01, "grad", fidelity_floor=0.2) == ("int", {"bits": 4, "block": 256})
    # nothing meets the floor at all: the most faithful candidate
    assert choose(10 * MBIT, 0.04, RAW, 0.01, "act", candidates=["int8", "topk:0.1"], fidelity_floor=0.999)[0] == "int8"


def test_adaptive_uses_measured_fidelities_so_sparse_activations_may_use_topk():
    x = torch.relu(gaussian(seed=12) - 2.0)  # ~2 % non-zero, like post-ReLU activations
    fids = measure_fidelities(x)
    assert fids["topk:0.05"] > 0.99 and fids["none"] == 1.0
    assert choose(10 * MBIT, 0.04, RAW, 0.1, "act", fidelities=fids) == ("topk", {"ratio": 0.05, "values": "fp16"})


def test_adaptive_evaluation_lists_lightest_first_with_transfer_times():
    opts = evaluate(10 * MBIT, 0.04, RAW)
    assert [o.spec for o in opts] == ["none", "fp16", "int8", "int:6", "int:4", "topk:0.25", "topk:0.1", "topk:0.05",
                                      "topk:0.01"]
    assert opts[0].transfer_s == pytest.approx(0.02 + RAW / (10 * MBIT))
    assert opts[2].wire_bytes == wire_bytes("int8", SHAPE)


@pytest.mark.parametrize("args,error", [
    ((0, 0.01, RAW, 0.1, "act"), "bandwidth"), ((float("nan"), 0.01, RAW, 0.1, "act"), "bandwidth"),
    ((1e6, -1, RAW, 0.1, "act"), "RTT"), ((1e6, 0.01, -5, 0.1, "act"), "raw_bytes"),
    ((1e6, 0.01, RAW, float("inf"), "act"), "budget"), ((1e6, 0.01, RAW, 0.1, "weights"), "kind"),
])
def test_adaptive_rejects_nonsense_inputs(args, error):
    with pytest.raises(ValueError, match=error):
        choose(*args)


def _noisy_transfers(policy, link, bw, rng, n, noise=0.1, nbytes=RAW // 4, rtt=0.04):
    """Feeds n transfers at bw ± noise; returns the codecs decided after each."""
    out = []
    for _ in range(n):
        policy.observe(link, nbytes, rtt / 2 + nbytes / (bw * (1 + rng.uniform(-noise, noise))))
        out.append(policy.decide(link, RAW, BUDGET, "act")[0])
    return out


def test_adaptive_policy_goes_no_lossier_than_the_planned_codec_and_the_planner_may_plan_its_lossiest():
    policy = AdaptivePolicy(fidelity_floors={"act": 0.95, "grad": 0.95})
    policy.set_link("a->b", 10 * MBIT, rtt_s=0.04)
    assert policy.decide("a->b", RAW, 0.01, "act")[0] == "int"  # uncapped: 6-bit blocks
    assert policy.decide("a->b", RAW, 0.01, "act", cap="int8")[0] == "int8"
    assert policy.decide("a->b", RAW, 0.01, "grad", cap="none")[0] == "none"
    assert policy.decide("a->b", RAW, 10.0, "act", cap="int8")[0] == "none"  # lighter than the cap is fine
    assert plannable() == ("none", "fp16", "int8", "int:6")  # what the policy may send at floor 0.95
    assert compression_ratio("int:6") == pytest.approx(wire_bytes("int", (1 << 20,), bits=6) / (4 << 20), rel=1e-3)


BW0 = 10 * MBIT
BUDGET = 0.02 + 0.5 * RAW / BW0  # fp16 hides exactly at BW0: the worst place for noise


def test_adaptive_policy_holds_its_choice_under_10pct_bandwidth_noise():
    policy = AdaptivePolicy()
    policy.set_link("a->b", BW0, rtt_s=0.04)
    assert policy.decide("a->b", RAW, BUDGET, "act")[0] == "fp16"
    assert set(_noisy_transfers(policy, "a->b", BW0, random.Random(0), 200)) == {"fp16"}
    # without hysteresis or smoothing the same noise makes it flip back and forth
    jumpy = AdaptivePolicy(hysteresis=0.0, smoothing=1.0)
    jumpy.set_link("a->b", BW0, rtt_s=0.04)
    seq = _noisy_transfers(jumpy, "a->b", BW0, random.Random(0), 200)
    assert sum(a != b for a, b in zip(seq, seq[1:])) > 20


def test_adaptive_policy_follows_real_bandwidth_changes():
    policy = AdaptivePolicy()
    policy.set_link("a->b", BW0, rtt_s=0.04)
    rng = random.Random(1)
    assert policy.decide("a->b", RAW, BUDGET, "act")[0] == "fp16"
    assert _noisy_transfers(policy, "a->b", BW0, rng, 5)[-1] == "fp16"
    assert _noisy_transfers(policy, "a->b", BW0 / 2, rng, 20)[-1] == "int8"  # halved: compress more
    assert _noisy_transfers(policy, "a->b", BW0 * 4, rng, 20)[-1] == "none"  # quadrupled: not at all
    assert policy.current("a->b", "act") == "none"
    assert policy.bandwidth("a->b") == pytest.approx(BW0 * 4, rel=0.05)


def test_adaptive_policy_smooths_and_ignores_latency_bound_samples():
    policy = AdaptivePolicy(smoothing=0.5, min_sample_bytes=1000)
    assert policy.observe("l", 500, 0.001) is None  # too small to say anything about bandwidth
    assert policy.observe("l", 10_000, 0.01) == pytest.approx(1e6)
    assert policy.observe("l", 10_000, 0.005) == pytest.approx(1.5e6)
    with pytest.raises(ValueError, match="no bandwidth known"):
        policy.decide("other", RAW, 0.1, "act")
