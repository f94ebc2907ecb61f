import contextlib
import json
import math
import os
import time

import pytest
import torch

from spantrain_p2p.profile import DeviceProfile, FlopCache, ProfileError, VirtualDevice, profile_layers
from spantrain_p2p.profile.profiler import ProfileCache, model_fingerprint
from spantrain_p2p.models.model import ModelConfig, build_layers

pytestmark = pytest.mark.serial  # measures times or rates: run alone (scripts/test.sh)

CFG = ModelConfig(dim=64, depth=2, heads=4, seq_len=32)
SHAPE = (4, 32)


@pytest.fixture
def one_thread():
    """Profile with one intra-op thread, as an emulated peer sharing the CPU should: several OpenMP
    threads on an oversubscribed CPU wait for each other and make the CPU time erratic."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def layers():
    return build_layers(CFG)


def test_a_profile_has_f_b_w_times_for_every_layer(layers, one_thread):
    p = profile_layers(layers, SHAPE, warmup=1, reps=3)
    assert p.num_layers == len(layers) == 4
    assert all(t > 0 for t in p.fwd_s)
    assert p.bwd_input_s[0] == 0.0 and all(t > 0 for t in p.bwd_input_s[1:])  # token ids have no gradient
    assert all(t > 0 for t in p.bwd_weight_s)
    assert p.memory_bytes > 0 and p.effective_tflops > 0
    assert DeviceProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_measured_speed_ratios_of_virtual_devices_match_the_configured_ones(layers, one_thread):
    # padding dominates: a block's forward takes ~0.3 ms of CPU and is padded to 27 ms (fast) or 109 ms
    # (slow), long enough that a loaded CPU waking a thread a millisecond late does not blur a 10 % check
    flops = FlopCache()
    fast = VirtualDevice(tflops=4.0, scale=1.25e-4, memory_bytes=48 << 30)  # 0.5 GFLOP/s in real time
    slow = VirtualDevice(tflops=1.0, scale=1.25e-4, memory_bytes=16 << 30)
    pf = profile_layers(layers, SHAPE, device=fast, warmup=0, reps=3, flop_cache=flops)
    ps = profile_layers(layers, SHAPE, device=slow, warmup=0, reps=3, flop_cache=flops)
    ratio = ps.total_s / pf.total_s
    print(f"FIGURE virtual devices 4 vs 1 TFLOP/s: measured ratio {ratio:.3f} ({ratio / 4 - 1:+.1%}), "
          f"{pf.effective_tflops / fast.scale:.3f} and {ps.effective_tflops / slow.scale:.3f} TFLOP/s, "
          f"fidelity {fast.fidelity():.3f} / {slow.fidelity():.3f} over {fast.stats().padded_ops} / {slow.stats().padded_ops} padded ops")
    assert ratio == pytest.approx(4.0, rel=0.10)
    assert pf.effective_tflops / fast.scale == pytest.approx(4.0, rel=0.10)
    assert ps.effective_tflops / slow.scale == pytest.approx(1.0, rel=0.10)
    for i in range(1, len(layers)):  # layer by layer too, where there are FLOPs to pad
        assert ps.fwd_s[i] / pf.fwd_s[i] == pytest.approx(4.0, rel=0.15)
    assert (pf.memory_bytes, ps.memory_bytes) == (48 << 30, 16 << 30)
    assert fast.fidelity() >= 0.95 and slow.fidelity() >= 0.95


def test_profiles_are_cached_per_model_shape_and_device(layers, tmp_path, one_thread):
    def no_timer():
        raise AssertionError("measured again instead of using the cache")

    dev = VirtualDevice(tflops=100.0, scale=1.0)
    p = profile_layers(layers, SHAPE, device=dev, reps=1, warmup=0, cache_dir=str(tmp_path))
    assert len(os.listdir(tmp_path)) == 1
    assert profile_layers(layers, SHAPE, device=dev, reps=1, cache_dir=str(tmp_path), timer=no_timer) == p
    with pytest.raises(AssertionError):  # another shape, device or model is measured anew
        profile_layers(layers, (2, 32), device=dev, reps=1, cache_dir=str(tmp_path), timer=no_timer)
    with pytest.raises(AssertionError):
        profile_layers(layers, SHAPE, device=VirtualDevice(50.0), reps=1, cache_dir=str(tmp_path), timer=no_timer)
    with pytest.raises(AssertionError):
        profile_layers(layers, SHAPE, device=dev, reps=1, cache_dir=str(tmp_path), fingerprint="other", timer=no_timer)
    # a corrupt cache file is a miss, not a crash, and is replaced
    path = ProfileCache(str(tmp_path)).path(model_fingerprint(layers), SHAPE, dev.key)
    with open(path, "w") as f:
        f.write('{"key": 1, "profile": {"fwd_s": [-1]}}')
    q = profile_layers(layers, SHAPE, device=dev, reps=1, warmup=0, cache_dir=str(tmp_path))
    assert ProfileCache(str(tmp_path)).get(model_fingerprint(layers), SHAPE, dev.key) == q


class FlakyTimer:
    """perf_counter, except that some readings come out zero, negative, NaN or absurd."""

    def __init__(self, bad_every: int, always: bool = False):
        self.calls = 0
        self.bad_every = bad_every
        self.always = always
        self.injected = 0
        self._start = None

    def __call__(self):
        import time

        self.calls += 1
        now = time.perf_counter()
        if self.calls % 2:  # a start reading
            self._start = now
            return now
        n = self.calls // 2
        if self.always or n % self.bad_every == 0:
            self.injected += 1
            return [self._start, self._start - 1.0, math.nan, self._start + 1e6][self.injected % 4]
        return now


def test_zero_negative_nan_or_absurd_readings_are_measured_again_never_returned(layers, one_thread):
    timer = FlakyTimer(bad_every=5)
    p = profile_layers(layers, SHAPE, reps=3, warmup=1, timer=timer)
    assert timer.injected >= 5
    for col in (p.fwd_s, p.bwd_input_s[1:], p.bwd_weight_s):
        assert all(math.isfinite(t) and 0 < t < 1.0 for t in col)


class ThreadClock:
    """A clock on which time passes only while this thread computes (its CPU time) or sleeps (the
    sleeps are counted, not waited): another process's load on the host does not move it, so a
    repetition is late on it only where a test makes it late."""

    def __init__(self):
        self.t0, self.slept = time.thread_time(), 0.0

    def __call__(self) -> float:
        return time.thread_time() - self.t0 + self.slept

    def sleep(self, s: float) -> None:
        self.slept += max(0.0, s)


class BusyHost(VirtualDevice):
    """A virtual device whose host is busy elsewhere during some forward operations: they overrun
    their padded budget (what seven emulated peers on two cores do to each other). Its time is a
    ``ThreadClock``'s: the stalls are the only lateness, whatever else the host is running."""

    def __init__(self, *args, busy_forwards, stall_s, **kwargs):
        clock = ThreadClock()
        super().__init__(*args, clock=clock, sleep=clock.sleep, **kwargs)
        self.busy_forwards, self.stall_s, self.forwards = set(busy_forwards), stall_s, 0

    @contextlib.contextmanager
    def op(self, phase, flops):
        with super().op(phase, flops):
            yield
            if phase == "F" and flops > 0:
                self.forwards += 1
                if self.forwards in self.busy_forwards:
                    self.clock.sleep(self.stall_s)  # the host ran something else for stall_s


def test_a_repetition_the_host_could_not_keep_up_with_is_measured_again(layers, one_thread):
    clean_dev = BusyHost(0.0002, busy_forwards=[], stall_s=0.0)
    clean = profile_layers(layers, SHAPE, device=clean_dev, warmup=1, reps=3, timer=clean_dev.clock)
    assert clean_dev.stats().late == 0  # on its own clock, a device the host keeps up with
    budget = max(clean.fwd_s)
    # of the first padded layer's measured forwards (its warm-up is forward 1), three stall; the padding
    # is counted, not waited, so a slow device (forwards of ~70 ms) costs no time and leaves room for
    # a collection of Python's garbage in an operation
    busy = BusyHost(0.0002, busy_forwards=[2, 4, 5], stall_s=3 * budget)
    report = {}
    p = profile_layers(layers, SHAPE, device=busy, warmup=1, reps=3, report=report, timer=busy.clock)
    assert busy.stats().late == 3 and report["late_layers"] == []
    assert max(b / a for a, b in zip(clean.fwd_s, p.fwd_s) if a > 1e-3) < 1.5, (clean.fwd_s, p.fwd_s)  # padded ones
    # a host that never keeps up: the last try counts, nothing raises
    stuck = BusyHost(0.0002, busy_forwards=range(1, 1000), stall_s=2 * budget)
    p = profile_layers(layers, SHAPE, device=stuck, warmup=1, reps=2, max_retries=1, report=report, timer=stuck.clock)
    assert report["late_layers"] == [i for i, t in enumerate(clean.fwd_s) if t > 1e-3]  # the padded ones
    assert stuck.forwards == 3 * (1 + 2 + 1)  # three padded layers: a warm-up, two repetitions, one more try
    assert sum(b / a > 1.5 for a, b in zip(clean.fwd_s, p.fwd_s) if a > 1e-3) == 3  # the stalls are in the profile


def test_a_device_that_never_gives_a_sane_reading_raises_instead_of_publishing(layers, tmp_path):
    with pytest.raises(ProfileError):
        profile_layers(layers, SHAPE, reps=2, max_retries=2, timer=FlakyTimer(1, always=True), cache_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing cached either


@pytest.mark.parametrize("change", [
    {"fwd_s": [0.0, 1.0]},  # a zero forward
    {"fwd_s": [-1.0, 1.0]},
    {"bwd_input_s": [float("nan"), 1.0]},
    {"bwd_weight_s": [1.0]},  # wrong length
    {"bwd_weight_s": [1.0, 1e9]},  # absurd
    {"memory_bytes": -5},
    {"memory_bytes": 1.5},
    {"effective_tflops": float("inf")},
    {"version": 2},
    {"extra": 1},
    {"fwd_s": "fast"},
    {"fwd_s": []},
    {"step_s_per_param_byte": -1e-9},
    {"step_s_per_param_byte": 1.0},  # absurd
    {"step_s_per_param_byte": "slow"},
    {"host_step_s_per_param_byte": -1e-9},
    {"host_step_s_per_param_byte": float("nan")},
    {"host_bytes_per_s": -1.0},
    {"host_bytes_per_s": float("inf")},
    {"host_bytes_per_s": 1e15},  # absurd
    {"host_bytes_per_s": True},
])
def test_a_profile_from_the_network_is_validated(change):
    good = {"version": 1, "fwd_s": [0.1, 0.2], "bwd_input_s": [0.0, 0.2], "bwd_weight_s": [0.1, 0.3],
            "memory_bytes": 1 << 30, "effective_tflops": 1.5}
    assert DeviceProfile.from_dict(good).total_s == pytest.approx(0.9)
    with pytest.raises(ValueError):
        DeviceProfile.from_dict({**good, **change})
    with pytest.raises(ValueError):
        DeviceProfile.from_dict({k: v for k, v in good.items() if k != "fwd_s"})
    # the step's tail is optional (a peer that does not measure it: 0), and kept where given
    assert DeviceProfile.from_dict(good).step_s_per_param_byte == 0.0
    assert DeviceProfile.from_dict({**good, "step_s_per_param_byte": 2e-9}).step_s_per_param_byte == 2e-9
    # so is the host's (measured where the job offloads its optimizer), and it goes out with the profile
    assert DeviceProfile.from_dict(good).host_step_s_per_param_byte == 0.0
    host = DeviceProfile.from_dict({**good, "host_step_s_per_param_byte": 3e-10})
    assert DeviceProfile.from_dict(host.to_dict()).host_step_s_per_param_byte == 3e-10
    # and the rate of its copies to and from host memory
    assert DeviceProfile.from_dict(good).host_bytes_per_s == 0.0
    copies = DeviceProfile.from_dict({**good, "host_bytes_per_s": 8e9})
    assert DeviceProfile.from_dict(copies.to_dict()).host_bytes_per_s == 8e9


def test_the_steps_tail_is_measured_per_byte_of_weights_and_leaves_the_layers_alone():
    """``profile.step_tail``: an optimizer step per byte of weights, on copies of the layers'
    parameters: Adam's, with its two moments to step, costs more than plain SGD's; the layers' weights are untouched."""
    from spantrain_p2p.profile import step_tail

    layers = build_layers(CFG)
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    adam = min(step_tail.measure(layers, lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)) for _ in range(3))
    sgd = min(step_tail.measure(layers, lambda ps: torch.optim.SGD(ps, lr=1e-3)) for _ in range(3))
    assert 0 < sgd < adam < step_tail.MAX_S_PER_BYTE
    assert all(torch.equal(a, p) for a, p in zip(before, (p for layer in layers for p in layer.parameters())))
    assert step_tail.measure([torch.nn.ReLU()], lambda ps: torch.optim.SGD(ps, lr=1e-3)) == 0.0


def test_the_offloads_copy_rate_is_timed_through_its_copies_and_leaves_the_layers_alone():
    """``step_tail.copy_rate``: bytes a second of what an offloaded optimizer's step copies (each weight
    and its gradient to host memory and the weight back: 3 bytes a weight byte), stepping nothing
    between them (``job.offload.copies_only``); the layers' weights are untouched."""
    from spantrain_p2p.job.offload import copies_only
    from spantrain_p2p.profile import step_tail

    layers = build_layers(CFG)
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    rate = max(step_tail.copy_rate(layers, copies_only) for _ in range(3))
    assert 1e8 < rate < step_tail.MAX_BYTES_PER_S  # this box's memory copies: 5-10 GB/s
    assert all(torch.equal(a, p) for a, p in zip(before, (p for layer in layers for p in layer.parameters())))
    params = [p.detach().clone().requires_grad_(True) for p in before]
    for p in params:
        p.grad = torch.ones_like(p)
    off = copies_only(params)
    off.step()
    assert off.copied_bytes == 3 * sum(p.numel() * p.element_size() for p in params)
    assert all(torch.equal(a, p) for a, p in zip(before, params))  # nothing stepped: the weights come back as they went
    assert step_tail.copy_rate([torch.nn.ReLU()], copies_only) == 0.0
