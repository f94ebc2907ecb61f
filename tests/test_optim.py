"""The job's optimizer: torch's fused Adam kernel where it runs, ``foreach`` elsewhere."""
import torch

from spantrain_p2p.job.optim import adam_kernel, make_optimizer
from spantrain_p2p.job.spec import JobSpec, ModelHandle


def _model(seed: int):
    torch.manual_seed(seed)
    handle = ModelHandle(JobSpec(model_args={"dim": 32, "depth": 2, "heads": 2}))
    return [p for layer in handle.build(0, handle.num_layers) for p in layer.parameters()]


def test_dense_cpu_floats_step_fused_and_others_through_foreach():
    params = _model(0)
    opt = make_optimizer(JobSpec(), params)
    assert opt.param_groups[0]["fused"] is True and not opt.param_groups[0]["foreach"]
    assert adam_kernel([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]) == {"fused": True}
    # a device or a layout the fused kernel refuses: the multi-tensor path, as before
    assert adam_kernel([torch.nn.Parameter(torch.zeros(3, device="meta"))]) == {"foreach": True}
    assert adam_kernel([torch.nn.Parameter(torch.zeros(3, 3).to_sparse())]) == {"foreach": True}
    assert adam_kernel([]) == {"foreach": True}
    meta = make_optimizer(JobSpec(), [torch.nn.Parameter(torch.zeros(3, device="meta"))])
    assert meta.param_groups[0]["foreach"] is True and not meta.param_groups[0]["fused"]


def test_the_fused_step_is_adams_arithmetic_within_float_rounding():
    """Twenty steps of the built-in model's parameters, fused against ``foreach``, on the same
    gradients: the weights agree to a few units in the last place (the kernels order the terms
    differently), and each side is bit-exact with itself (every peer and the reference step alike)."""
    a, b, c = _model(1), _model(1), _model(1)
    fused = make_optimizer(JobSpec(), a)
    again = make_optimizer(JobSpec(), c)
    multi = torch.optim.Adam(b, lr=JobSpec().lr, foreach=True)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        for p, q, r in zip(a, b, c):
            g = torch.randn(p.shape, generator=gen) * 1e-2
            p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
        fused.step(), multi.step(), again.step()
    assert all(torch.equal(p, r) for p, r in zip(a, c))
    worst = max(((p - q).abs() / q.abs().clamp_min(1e-3)).max().item() for p, q in zip(a, b))
    assert 0 <= worst < 1e-5, worst
    moved = max((p - q).abs().max().item() for p, q in zip(a, _model(1)))
    assert moved > 1e-3  # the steps did move the weights
