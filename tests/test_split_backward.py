"""A zero-bubble stage's split backward (``pipeline.split_backward``): B then W gives the weight and
input gradients one fused backward gives, bit for bit, and B alone leaves the weights untouched."""
import torch
import torch.nn.functional as F
from torch import nn

from spantrain_p2p.data import generated as data
from spantrain_p2p.job.spec import JobSpec, ModelHandle
from spantrain_p2p.pipeline import schedule as sched
from spantrain_p2p.pipeline import split_backward
from spantrain_p2p.pipeline.executor import StageExecutor, _Mb

JOB = JobSpec(model_args={"dim": 32, "depth": 4, "heads": 2}, seq_len=16, micro_batch_size=2, num_micro_batches=2)


def _executor(first: int, last: int) -> StageExecutor:
    handle = ModelHandle(JOB)
    torch.manual_seed(0)
    return StageExecutor(handle.build(first, last), first == 0, last == handle.num_layers, 2,
                         lambda s, m: data.batch(0, s, m, JOB.micro_batch_size, JOB.seq_len), None, None)


def _run(ex: StageExecutor, x: torch.Tensor, grad: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """Two micro-batches forward and backward (split or fused); the input gradients."""
    ins = []
    for mb in range(2):
        st = _Mb(inp=x[mb].clone().requires_grad_(True))
        ex._forward(0, mb, st)
        st.grad_out = grad[mb]
        if split:
            ex._backward_input(st)
            ins.append(st.grad_in)
            ex._backward_weight(st)
        else:
            ex._backward_full(st)
            ins.append(st.grad_in)
    return ins


def _inputs(shape) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, *shape, generator=g), torch.randn(2, *shape, generator=g)


def test_split_b_and_w_give_the_fused_backward_s_gradients_bit_for_bit_and_b_alone_touches_no_weight():
    handle = ModelHandle(JOB)
    shape = handle.boundary_shapes()[1]
    x, grad = _inputs(shape)
    fused, split = _executor(1, 3), _executor(1, 3)
    assert split_backward.install(list(split.layers), split._deferral) == 8  # 4 linear layers a block
    want_in = _run(fused, x, grad, split=False)
    got_in = _run(split, x, grad, split=True)
    assert all(torch.equal(a, b) for a, b in zip(want_in, got_in))
    for p, q in zip(fused.params, split.params):
        assert torch.equal(p.grad, q.grad) and q.grad.grad_fn is None
    # B alone (what a spot check runs): the input gradient, and no weight's gradient
    split.zero_grad()
    st = _Mb(inp=x[0].clone().requires_grad_(True))
    split._forward(0, 0, st)
    st.grad_out = grad[0]
    split._backward_input(st)
    assert torch.equal(st.grad_in, want_in[0])
    assert all(p.grad is None for p in split.params)


def test_a_step_that_splits_installs_it_and_trains_as_a_fused_step_does():
    """Through ``run_step``: a list whose W's come after other work (as on ZB-H1's later stages)
    installs the split; the losses and weight gradients are a fused step's, bit for bit."""
    import asyncio

    F_, B, W, BW = sched.Op.F, sched.Op.B, sched.Op.W, sched.Op.BW
    lists = {"fused": [(F_, 0), (F_, 1), (BW, 0), (BW, 1)],
             "split": [(F_, 0), (F_, 1), (B, 0), (B, 1), (W, 0), (W, 1)]}

    async def step(kind: str):
        ex = _executor(0, ModelHandle(JOB).num_layers)
        result = await ex.run_step(0, [sched.Action(op, mb) for op, mb in lists[kind]])
        ex.close()
        return ex, result

    (fused, r1), (split, r2) = asyncio.run(step("fused")), asyncio.run(step("split"))
    assert not fused._split_installed and split._split_installed
    assert r1.losses == r2.losses
    for p, q in zip(fused.params, split.params):
        assert torch.equal(p.grad, q.grad)


class _Tied(nn.Module):
    """A layer that uses a linear layer's weight a second time outside it, and has a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.frozen(self.a(x)) + F.linear(x, self.a.weight))


def test_a_weight_used_outside_its_linear_layer_and_a_frozen_one_come_out_as_autograd_s():
    """The weight used twice gets both parts (summed in another order: equal up to rounding)."""
    torch.manual_seed(1)
    layers = [_Tied(), _Tied()]
    copies = [_Tied(), _Tied()]
    for a, b in zip(layers, copies):
        b.load_state_dict(a.state_dict())
    x, grad = torch.randn(2, 4, 8), torch.randn(2, 4, 8)

    def run(ls, split: bool):
        ex = StageExecutor(ls, False, False, 2, None, None, None)
        if split:
            split_backward.install(list(ex.layers), ex._deferral)
        return ex, _run(ex, x, grad, split)

    (fused, want), (split, got) = run(copies, False), run(layers, True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for (name, p), q in zip(fused.layers.named_parameters(), split.layers.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert q.grad.grad_fn is None
            if name.endswith("a.weight"):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(p.grad, q.grad), name
    assert all(m.frozen.weight.grad is None for m in split.layers)


def test_a_forward_before_the_install_still_gets_its_weight_gradients_from_b_and_w():
    handle = ModelHandle(JOB)
    x, grad = _inputs(handle.boundary_shapes()[1])
    fused, split = _executor(1, 3), _executor(1, 3)
    _run(fused, x, grad, split=False)
    sts = []
    for mb in range(2):  # forwards with plain linear layers, then the install, then B and W
        st = _Mb(inp=x[mb].clone().requires_grad_(True))
        split._forward(0, mb, st)
        st.grad_out = grad[mb]
        sts.append(st)
    split_backward.install(list(split.layers), split._deferral)
    for st in sts:
        split._backward_input(st)
        split._backward_weight(st)
    for p, q in zip(fused.params, split.params):
        assert torch.equal(p.grad, q.grad)
