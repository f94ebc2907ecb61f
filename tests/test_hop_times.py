"""hop_times: the hops a waiting stage paid for, and a step's time with one stage computing."""
import pytest

from spantrain_p2p.train.hop_times import hop_times


def two_stages(step: int, t0: float, wire: float = 0.002, turn: float = 0.001) -> dict[int, dict]:
    """One micro-batch through two stages: stage 0 computes F 0-10 ms, its loop sends after
    ``turn``, stage 1 (waiting since 0) takes it ``wire`` later, computes F and BW for 20 ms, sends
    the gradient back the same way; stage 0 waits for it and runs its BW for 10 ms."""
    f_end = t0 + 0.010
    taken = f_end + turn + wire
    s1_end = taken + 0.020
    g_taken = s1_end + turn + wire
    s0 = {"step": step, "start": t0, "end": g_taken + 0.010, "ops": [
        ["F", 0, t0, f_end], ["SEND_F", 0, f_end + turn, taken + 0.0005],
        ["RECV_B", 0, f_end + 0.0001, g_taken], ["BW", 0, g_taken, g_taken + 0.010]]}
    s1 = {"step": step, "start": t0, "end": s1_end + turn, "ops": [
        ["RECV_F", 0, t0, taken], ["F", 0, taken, taken + 0.010], ["BW", 0, taken + 0.010, s1_end],
        ["SEND_B", 0, s1_end + turn, g_taken + 0.0005]]}
    return {0: s0, 1: s1}


def test_hops_whose_receiver_waited_are_split_at_the_send():
    a, b = two_stages(0, 100.0), two_stages(1, 100.1)
    h = hop_times({0: [a[0], b[0]], 1: [a[1], b[1]]})
    assert h["steps"] == 2 and h["count"] == 4  # an activation and a gradient a step, each waited for
    assert h["made_to_taken"]["median_ms"] == pytest.approx(3.0)
    assert h["made_to_send"]["median_ms"] == pytest.approx(1.0)
    assert h["send_to_taken"]["median_ms"] == pytest.approx(2.0)
    assert h["made_to_taken"]["per_step_ms"] == pytest.approx(6.0)


def test_a_tensor_made_before_its_wait_began_costs_nothing():
    a = two_stages(0, 100.0)
    a[1]["ops"][0][2] = 100.011  # stage 1 began waiting only after stage 0's F had ended
    h = hop_times({0: [a[0]], 1: [a[1]]})
    assert h["count"] == 1  # the gradient's hop only


def test_a_step_with_one_stage_computing():
    # step 0 from 100.0 to 100.1 (the first stage's next start): F 10 ms alone, 3 ms of hop with
    # nothing under way, stage 1's 20 ms alone, 3 ms of hop, stage 0's BW 10 ms; then idle to 100.1
    a, b = two_stages(0, 100.0), two_stages(1, 100.1)
    h = hop_times({0: [a[0], b[0]], 1: [a[1], b[1]]})
    assert h["single_s"] == pytest.approx(0.1)
    assert h["idle_s"] == pytest.approx(0.1 - 0.040)


def test_stages_without_a_common_step_give_no_figures():
    a, b = two_stages(0, 100.0), two_stages(1, 100.1)
    h = hop_times({0: [a[0]], 1: [b[1]]})
    assert h["steps"] == 0 and h["count"] == 0 and h["single_s"] is None
    assert h["made_to_taken"]["median_ms"] is None


def test_time_with_two_stages_computing_is_not_single():
    a, b = two_stages(0, 100.0), two_stages(1, 100.1)
    a[1]["ops"].append(["W", 1, 100.002, 100.007])  # 5 ms while stage 0's F runs
    h = hop_times({0: [a[0], b[0]], 1: [a[1], b[1]]})
    assert h["single_s"] == pytest.approx(0.1 - 0.005)
    assert h["idle_s"] == pytest.approx(0.1 - 0.040)


def test_a_hop_splits_where_the_receiver_kept_its_tensors_arrivals():
    # the activation's 2 ms from the send's start to taken: its first byte 0.5 ms in, whole 0.3 ms
    # later, filed 0.4 ms after that, taken 0.8 ms after that; the gradient's arrival was not kept
    a = two_stages(0, 100.0)
    send = 100.0 + 0.010 + 0.001
    a[1]["arrivals"] = [["act", 0, send + 0.0005, send + 0.0008, send + 0.0012]]
    h = hop_times({0: [a[0]], 1: [a[1]]})
    assert h["count"] == 2 and h["split"] == 1  # of the two hops, one has its arrival
    assert h["send_to_first_byte"]["median_ms"] == pytest.approx(0.5)
    assert h["first_byte_to_whole"]["median_ms"] == pytest.approx(0.3)
    assert h["whole_to_filed"]["median_ms"] == pytest.approx(0.4)
    assert h["filed_to_taken"]["median_ms"] == pytest.approx(0.8)


def test_timelines_without_arrivals_give_no_split():
    a = two_stages(0, 100.0)
    h = hop_times({0: [a[0]], 1: [a[1]]})
    assert h["split"] == 0 and "send_to_first_byte" not in h
