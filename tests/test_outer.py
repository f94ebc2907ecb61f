"""The outer optimizer of islands (pure tensor arithmetic): the delayed merge keeps every island's
anchor equal, replays local steps, and with one island, lossless codec, lr 1 and no momentum
changes nothing at all."""
from __future__ import annotations

import torch

from spantrain_p2p.islands.outer import Contribution, OuterLayers, flat


def _layers(seed):
    g = torch.Generator().manual_seed(seed)
    return {0: [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)], 1: [torch.randn(5, generator=g)]}


def _local_step(layers, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ps in layers.values():
            for p in ps:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _round_end(outer, pending, tokens):
    """What a peer does at a round's end: progress, merge of the previous round, replay, encode."""
    prog = outer.progress()
    if pending is not None:
        outer.merge(pending)
    outer.replay(prog)
    return {i: Contribution(tokens, dec) for i, (_m, _b, dec) in outer.encode(prog).items()}


def test_one_island_lossless_at_lr_one_without_momentum_is_plain_local_training():
    layers = _layers(0)
    ref = {i: [p.clone() for p in ps] for i, ps in layers.items()}
    outer = OuterLayers(layers, "none", lr=1.0, momentum=0.0)
    pending = None
    for r in range(4):
        for s in range(3):
            _local_step(layers, 100 * r + s)
            _local_step(ref, 100 * r + s)
        mine = _round_end(outer, pending, tokens=10)
        pending = {i: [c] for i, c in mine.items()}
    for i in layers:
        assert torch.allclose(flat(layers[i]), flat(ref[i]), atol=1e-5)
    outer.merge(pending)
    outer.reset_to_anchor()
    for i in layers:
        assert torch.allclose(flat(layers[i]), flat(ref[i]), atol=1e-5)


def test_islands_that_exchange_compressed_contributions_hold_the_same_anchor():
    a_layers, b_layers = _layers(0), _layers(0)
    a, b = OuterLayers(a_layers, "topk:0.3"), OuterLayers(b_layers, "topk:0.3")
    pending = None
    for r in range(5):
        for s in range(2):
            _local_step(a_layers, 1000 + 10 * r + s)
        for s in range(4):  # b is twice as fast: twice the steps, twice the tokens
            _local_step(b_layers, 2000 + 10 * r + s)
        ca = _round_end(a, pending, tokens=2)
        cb = _round_end(b, pending, tokens=4)
        pending = {i: [ca[i], cb[i]] for i in ca}
        for i in a.anchor:
            assert torch.equal(a.anchor[i], b.anchor[i])
    a.merge(pending)
    b.merge(pending)
    a.reset_to_anchor()
    b.reset_to_anchor()
    for i in a_layers:
        assert torch.equal(flat(a_layers[i]), flat(b_layers[i]))
    assert a.merged_rounds == 5


def test_the_weighted_average_counts_tokens_and_nesterov_matches_torch_sgd():
    layers = {0: [torch.zeros(3)]}
    outer = OuterLayers(layers, "none", lr=0.7, momentum=0.9)
    ref = torch.zeros(3, requires_grad=True)
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for r in range(3):
        c1, c2 = torch.tensor([1.0, 2.0, 3.0]) * (r + 1), torch.tensor([-1.0, 0.0, 5.0])
        outer.merge({0: [Contribution(1, c1), Contribution(3, c2)]})
        ref.grad = (c1 * 1 + c2 * 3) / 4
        sgd.step()
        assert torch.allclose(outer.anchor[0], ref.detach(), atol=1e-6)


def test_error_feedback_delays_what_the_codec_drops_and_loses_nothing():
    layers = {0: [torch.zeros(1000)]}
    outer = OuterLayers(layers, "topk:0.05")
    g = torch.Generator().manual_seed(3)
    sent, true = torch.zeros(1000), torch.zeros(1000)
    for _ in range(6):
        prog = {0: torch.randn(1000, generator=g)}
        true -= prog[0]
        sent += outer.encode(prog)[0][2]
    residual = outer.feedback.residual(0)
    assert torch.allclose(sent + residual, true, atol=1e-4)
