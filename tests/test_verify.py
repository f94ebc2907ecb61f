"""Verified computation's pure parts (robust.verify): digests, the ledger, attestations, what a
neighbour finds wrong in one, the checks' choice and the comparison."""
import random

import pytest
import torch

from spantrain_p2p.pipeline.messages import ACT, GRAD, encode_tensor
from spantrain_p2p.robust import verify as vf


def _msg(kind=ACT, step=3, mb=1, src="b", scale=1.0):
    t = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(step * 10 + mb)) * scale
    return encode_tensor(kind, "job", 1, step, mb, src, t)


def test_a_digest_names_the_message_and_its_bytes():
    h, b = _msg()
    assert vf.digest(h, b) == vf.digest(dict(h), [bytes(x) for x in b])  # as received: the same
    h2, b2 = _msg(scale=1.0 + 1e-6)
    assert vf.digest(h, b2) != vf.digest(h, b)  # one value changed
    assert vf.digest({**h, "mb": 2}, b) != vf.digest(h, b)  # the same bytes, another micro-batch


def test_the_ledger_keeps_a_few_steps_and_says_what_this_peer_signs():
    led = vf.Ledger(keep_steps=2)
    for step in range(6):
        h, b = _msg(step=step)
        d = led.put("recv/act", "a", h, b)
        led.put("send/act", "c", *_msg(step=step, src="me"))
        assert led.mine(step)[1]["recv/act"] == d
    assert led.get(2, 1, "recv/act", "a") is None and led.get(3, 1, "recv/act", "a") is not None
    assert led.exchanged(5, "c") == {1: ["send/act"]} and led.exchanged(5, "a") == {1: ["recv/act"]}


def test_an_attestation_round_trips_and_bad_ones_are_refused():
    a = vf.attestation("job", 2, 7, 1, {"recv/act": "0" * 32, "send/act": "f" * 32})
    assert vf.parse_attestation(a) == ("job", 2, 7, 1, {"recv/act": "0" * 32, "send/act": "f" * 32})
    for bad in ({**a, "slots": {"other/slot": "0" * 32}}, {**a, "mb": "1"}, {**a, "step": True},
                {**a, "slots": {"recv/act": "short"}}, {**a, "slots": ["recv/act"]}):
        with pytest.raises(ValueError):
            vf.parse_attestation(bad)


def test_a_neighbour_finds_an_attestation_that_says_other_than_what_it_sent():
    mine = {0: {"recv/act": "a" * 32, "send/grad": "b" * 32}}
    honest = {0: {"send/act": "a" * 32, "recv/grad": "b" * 32, "recv/act": "c" * 32}}
    assert vf.disagreements(honest, mine, {0: ["recv/act", "send/grad"]}) == []
    liar = {0: {"send/act": "d" * 32, "recv/grad": "b" * 32}}
    assert vf.disagreements(liar, mine, {0: ["recv/act", "send/grad"]}) == ["micro-batch 0 send/act: signed dddddddd, was aaaaaaaa"]
    assert vf.disagreements({}, mine, {0: ["recv/act", "send/grad"]}) == []  # left out: the checker counts it


def test_checks_take_every_suspect_and_one_random_replica_at_rate_p():
    mbs = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    rng = random.Random(0)
    n = 4000
    picks = [vf.choose(rng, 0.05, mbs) for _ in range(n)]
    rate = sum(len(p) for p in picks) / n
    assert 0.04 < rate < 0.06 and all(m in mbs[x] for p in picks for x, m in p)
    always = [vf.choose(rng, 0.0, mbs, ["b"]) for _ in range(20)]
    assert all(len(p) == 1 and p[0][0] == "b" for p in always)


def test_the_relative_error_of_honest_float_noise_and_of_forgeries():
    y = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert vf.relative_error(y.clone(), y) == 0.0
    assert vf.relative_error(y.to(torch.bfloat16), y) < vf.TOLERANCE["bf16"]
    assert vf.relative_error(y * 1.01, y) > vf.TOLERANCE["fp32"]  # 1 % off is caught in fp32
    assert vf.relative_error(torch.zeros_like(y), y) == pytest.approx(1.0)
    assert vf.relative_error(y[:2], y) == float("inf")
    assert GRAD and vf.relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
