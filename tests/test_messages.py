import asyncio

import pytest
import torch

from spantrain_p2p.net import framing
from spantrain_p2p.net.framing import FrameError
from spantrain_p2p.pipeline.messages import ACT, GRAD, Expect, Inbox, decode_tensor, encode_tensor

EXPECT = Expect(ACT, "job1", 3, frozenset({"up"}), (2, 4, 8), num_microbatches=4)


def wire(header, bufs):
    """Encodes and decodes a frame, as the data plane does."""
    frame = b"".join(bytes(c) for c in framing.encode(header, bufs))
    return framing.decode(frame)


def test_a_tensor_round_trips_exactly():
    t = torch.randn(2, 4, 8)
    step, mb, got = decode_tensor(*wire(*encode_tensor(ACT, "job1", 3, 7, 2, "up", t)), EXPECT, (7, 8))
    assert (step, mb) == (7, 2) and torch.equal(got, t)


def test_a_tensor_from_a_received_buffer_owns_it_without_a_copy_and_one_from_bytes_gets_its_own():
    t = torch.randn(2, 4, 8)
    frame = bytearray(b"".join(bytes(c) for c in framing.encode(*encode_tensor(ACT, "job1", 3, 7, 2, "up", t))))
    _, _, got = decode_tensor(*framing.decode(frame), EXPECT, (7, 8))
    got.add_(1.0)  # writable: it is the received buffer itself
    assert torch.equal(got, t + 1.0)
    _, _, again = decode_tensor(*framing.decode(frame), EXPECT, (7, 8))
    assert torch.equal(again, got)
    _, _, copied = decode_tensor(*wire(*encode_tensor(ACT, "job1", 3, 7, 2, "up", t)), EXPECT, (7, 8))
    copied.add_(1.0)  # from read-only bytes: a copy of its own, so writing is allowed
    assert torch.equal(copied, t + 1.0)


@pytest.mark.parametrize("change,reason", [
    ({"shape": [2, 4, 9]}, "shape"),
    ({"dtype": "float16"}, "dtype"),
    ({"epoch": 2}, "epoch 2"),
    ({"job": "other"}, "job"),
    ({"src": "stranger"}, "not a neighbour"),
    ({"step": 9}, "step 9"),
    ({"mb": 4}, "micro-batch 4"),
    ({"kind": GRAD}, "kind"),
    ({"v": 2}, "version"),
    ({"step": "7"}, "'step'"),
    ({"shape": [2, 4, True]}, "shape"),
])
def test_a_message_that_does_not_match_the_stage_map_is_rejected(change, reason):
    header, bufs = encode_tensor(ACT, "job1", 3, 7, 2, "up", torch.zeros(2, 4, 8))
    header.update(change)
    with pytest.raises(FrameError, match=reason):
        decode_tensor(*wire(header, bufs), EXPECT, (7, 8))


def test_a_buffer_of_the_wrong_length_is_rejected():
    header, _ = encode_tensor(ACT, "job1", 3, 7, 2, "up", torch.zeros(2, 4, 8))
    with pytest.raises(FrameError, match="bytes"):
        decode_tensor(*wire(header, [b"\0" * 100]), EXPECT, (7, 8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_rejected(bad):
    t = torch.zeros(2, 4, 8)
    t[1, 3, 5] = bad
    with pytest.raises(FrameError, match="NaN or infinite"):
        decode_tensor(*wire(*encode_tensor(ACT, "job1", 3, 7, 2, "up", t)), EXPECT, (7, 8))


async def test_inbox_delivers_early_and_late_arrivals_and_refuses_duplicates():
    inbox = Inbox(2)
    inbox.put((ACT, 0, 0), torch.ones(1))
    assert torch.equal(await inbox.get((ACT, 0, 0), 1), torch.ones(1))
    waiter = asyncio.create_task(inbox.get((ACT, 0, 1), 1))
    await asyncio.sleep(0)
    inbox.put((ACT, 0, 1), torch.zeros(1))
    assert torch.equal(await waiter, torch.zeros(1))
    inbox.put((ACT, 1, 0), torch.ones(1))
    with pytest.raises(FrameError, match="duplicate"):
        inbox.put((ACT, 1, 0), torch.ones(1))
    inbox.put((ACT, 1, 1), torch.ones(1))
    with pytest.raises(FrameError, match="inbox full"):
        inbox.put((ACT, 1, 2), torch.ones(1))
    with pytest.raises(TimeoutError, match="no act for step 5 micro-batch 0"):
        await inbox.get((ACT, 5, 0), 0.05)


async def test_a_filed_tensor_wakes_its_waiting_taker_at_the_loops_next_turn():
    # one turn, not two (a shielded slot future took the shield's callback, then the wake-up)
    inbox = Inbox(4)
    taker = asyncio.create_task(inbox.get((GRAD, 3, 1), 5))
    await asyncio.sleep(0)
    inbox.put((GRAD, 3, 1), torch.ones(2))
    await asyncio.sleep(0)
    assert taker.done() and torch.equal(taker.result(), torch.ones(2))
    assert not inbox.arrived((GRAD, 3, 1))  # taken: its slot is free


async def test_a_taker_that_timed_out_still_gets_the_tensor_that_comes_later_and_a_dropped_step_cancels_it():
    inbox = Inbox(4)
    with pytest.raises(TimeoutError):
        await inbox.get((ACT, 2, 0), 0.01)
    inbox.put((ACT, 2, 0), torch.zeros(3))
    assert inbox.arrived((ACT, 2, 0))
    assert torch.equal(await inbox.get((ACT, 2, 0), 0.01), torch.zeros(3))
    waiting = asyncio.create_task(inbox.get((ACT, 2, 1), 5))
    await asyncio.sleep(0)
    inbox.drop_before(3)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    inbox.put((ACT, 3, 0), torch.ones(1))  # the dropped slot is gone: a later step's tensor is filed
    assert inbox.arrived((ACT, 3, 0)) and not inbox.arrived((ACT, 2, 1))


@pytest.mark.parametrize("codec,tol", [("fp16", 1e-3), ("int8", 2e-2), ("topk:0.5", 1.0)])
def test_compressed_tensors_decode_to_the_expected_shape(codec, tol):
    t = torch.randn(2, 4, 8)
    header, bufs = encode_tensor(ACT, "job1", 3, 7, 2, "up", t, codec)
    assert header["comp"]["codec"] == codec.split(":")[0]
    _, _, got = decode_tensor(*wire(header, bufs), EXPECT, (7, 8))
    assert got.shape == t.shape and float((got - t).norm() / t.norm()) <= tol


def test_a_hostile_compressed_tensor_is_rejected():
    header, bufs = encode_tensor(ACT, "job1", 3, 7, 2, "up", torch.randn(2, 4, 8), "int8")
    header["comp"] = {"codec": "int8", "block": 3}
    with pytest.raises(FrameError, match="compressed tensor rejected"):
        decode_tensor(*wire(header, bufs), EXPECT, (7, 8))
