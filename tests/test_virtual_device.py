import statistics
import threading
import time

import pytest
import torch
from torch import nn

from spantrain_p2p.profile.virtual import FlopCache, VirtualDevice, sleep_until
from spantrain_p2p.models.model import ModelConfig, build_layers, flops_per_layer

pytestmark = pytest.mark.serial  # measures times or rates: run alone (scripts/test.sh)


def test_an_operation_is_padded_to_flops_over_device_speed():
    dev = VirtualDevice(tflops=1.0, scale=1e-3)  # 1 GFLOP/s in real time
    assert dev.budget_s(5e6) == pytest.approx(0.005)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        with dev.op("F", 5e6):
            pass
        times.append(time.perf_counter() - t)
    # never short of the budget; over it by at most half a millisecond at best (a wake-up late on a
    # busy box only adds: the median of five read 5.55 ms in the serial suite at 18:17 UTC)
    assert min(times) >= 0.005 and min(times) < 0.0055, times
    s = dev.stats()
    assert s.ops == 5 and s.overruns == 0 and s.flops == 5 * 5e6 and dev.fidelity() == 1.0
    assert 0.025 <= s.busy_s < 0.035


def test_an_operation_slower_than_its_budget_counts_as_an_overrun():
    dev = VirtualDevice(tflops=1.0, scale=1e-3)
    dev.run(time.sleep, 0.004, flops=1e6, phase="B")  # 1 ms budget, 4 ms real
    dev.run(lambda: None, flops=1e6, phase="W")
    assert dev.stats().overruns == 1 and dev.fidelity() == 0.5 and dev.overrun_fraction() == 0.5
    assert dev.stats().phases["B"].worst_overrun > 3
    dev.reset()
    assert dev.stats().ops == 0 and dev.fidelity() == 1.0


def test_queued_operations_run_back_to_back_on_the_device_whenever_their_thread_begins_them():
    """An op queued (``ready``) while the device was still busy starts when the device is free, as a
    GPU's stream runs queued kernels: a thread that woke late from its last padding (here: 8 ms of
    the host elsewhere) does not delay the device; an op's own CPU work is never cut short, and one
    queued after the device went idle starts when it was queued. (Margins of several ms: a loaded
    host wakes threads late.)"""
    dev = VirtualDevice(tflops=1.0, scale=1e-3)  # 1 GFLOP/s: 1e7 FLOPs take 10 ms
    q = dev.clock()
    with dev.op("F", 1e7, q):
        pass
    time.sleep(0.008)  # the host is late to begin the next op, queued at q
    with dev.op("B", 1e7, q):
        pass
    assert 0.020 <= dev.clock() - q < 0.026  # the two budgets, not 28 ms
    assert dev.stats().phases["B"].caught_up_s == pytest.approx(0.008, abs=0.004)
    time.sleep(0.02)
    q = dev.clock()
    with dev.op("W", 1e7, q - 0.008):  # queued 8 ms ago, the device idle: 2 ms left, yet its CPU work (5 ms) runs
        time.sleep(0.005)
    assert 0.005 <= dev.clock() - q < 0.009
    time.sleep(0.01)
    q = dev.clock()
    with dev.op("F", 1e7, q):  # the device idled: the op starts when queued
        pass
    assert 0.010 <= dev.clock() - q < 0.014
    assert dev.stats().phases["W"].late == 1  # on the device 13 ms after it was queued, for 10 ms of budget


def test_operations_without_flops_run_unpadded_and_do_not_count_against_fidelity():
    dev = VirtualDevice(tflops=1.0, scale=1e-3)
    dev.run(time.sleep, 0.002, flops=0, phase="F")
    s = dev.stats()
    assert s.ops == 1 and s.padded_ops == 0 and s.phases["F"].unpadded_ops == 1 and dev.fidelity() == 1.0


def test_an_operation_that_raises_is_neither_padded_nor_counted():
    dev = VirtualDevice(tflops=1.0, scale=1e-3)
    t = time.perf_counter()
    with pytest.raises(ZeroDivisionError):
        with dev.op("F", 1e9):  # would be a whole second
            1 / 0
    assert time.perf_counter() - t < 0.1 and dev.stats().ops == 0


def test_padding_works_from_several_threads_at_once():
    dev = VirtualDevice(tflops=1.0, scale=1e-3)
    per_thread = {}

    def work(name):
        t = time.perf_counter()
        for _ in range(10):
            with dev.op("F", 3e6):  # 3 ms each
                pass
        per_thread[name] = time.perf_counter() - t

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # each thread's operations are padded on their own: 30 ms each, not 60 ms serialized
    assert all(0.030 <= v < 0.040 for v in per_thread.values()), per_thread
    assert dev.stats().ops == 20


def test_sleep_until_is_accurate_to_a_fraction_of_a_millisecond():
    late = []
    for _ in range(20):
        deadline = time.perf_counter() + 0.002
        sleep_until(deadline)
        late.append(time.perf_counter() - deadline)
    assert min(late) >= 0 and statistics.median(late) < 100e-6, late


def test_bad_device_parameters_are_refused():
    for kw in ({"tflops": 0}, {"tflops": -1}, {"tflops": float("nan")}, {"tflops": 1, "scale": 0}, {"tflops": True}):
        with pytest.raises(ValueError):
            VirtualDevice(**kw)
    with pytest.raises(ValueError):
        with VirtualDevice(1.0).op("X", 1.0):
            pass
    with pytest.raises(ValueError):
        with VirtualDevice(1.0).op("F", float("inf")):
            pass


def test_flops_come_from_torchs_counter_for_each_phase():
    lin = nn.Linear(16, 32)
    x = torch.randn(4, 16)
    fl = FlopCache().phase_flops(lin, (x,))
    mm = 2 * 4 * 16 * 32
    assert (fl.F, fl.B, fl.W) == (mm, mm, mm)


def test_a_transformer_blocks_counted_flops_include_attention_and_match_the_formula():
    cfg = ModelConfig(dim=64, depth=2, heads=4, seq_len=32)
    layers = build_layers(cfg)
    cache = FlopCache()
    x = torch.randn(4, 32, 64)
    fl = cache.phase_flops(layers[1], (x,))
    assert fl.F == flops_per_layer(cfg, 4)[1]  # matmuls and the (CPU) attention kernel
    assert fl.B > 0.9 * fl.F and fl.W > fl.F
    head = cache.phase_flops(layers[-1], (x, torch.zeros(4, 32, dtype=torch.long)))
    assert head.F == flops_per_layer(cfg, 4)[-1] and head.B > 0 and head.W > 0
    emb = cache.phase_flops(layers[0], (torch.zeros(4, 32, dtype=torch.long),))
    assert emb.B == 0  # token ids have no gradient


def test_flop_counts_are_cached_per_structure_and_shape():
    cfg = ModelConfig(dim=32, depth=2, heads=2, seq_len=16)
    layers = build_layers(cfg)
    cache = FlopCache()
    x = torch.randn(2, 16, 32)
    a = cache.phase_flops(layers[1], (x,))
    assert cache.phase_flops(layers[2], (x,)) == a and len(cache) == 1  # equal blocks share a count
    b = cache.phase_flops(layers[1], (torch.randn(4, 16, 32),))
    assert len(cache) == 2 and b.F == pytest.approx(2 * a.F)
    assert cache.flops(layers[1], "W", (x,)) == a.W


def test_counting_flops_in_one_thread_leaves_another_threads_backward_alone():
    """A LocalSwarm's peers share one process: one profiling (counting flops) while another trains.
    torch's counter split by module through process-wide module hooks, which put gradient hooks on
    the other thread's tensors; its ``autograd.grad`` to a leaf input then failed."""
    from spantrain_p2p.profile import virtual

    counting, done = threading.Event(), threading.Event()

    def count():
        with virtual._counter():
            counting.set()
            done.wait(30)

    t = threading.Thread(target=count)
    t.start()
    try:
        assert counting.wait(30)
        layer, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
        (g,) = torch.autograd.grad(layer(x).sum(), [x])  # raised RuntimeError with torch's module split
        assert g.shape == x.shape
    finally:
        done.set()
        t.join(30)
