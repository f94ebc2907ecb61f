"""A user model whose second layer's backward always raises (tests/test_python_api.py): every step
fails the same way, as a bug in a user's model would."""
import torch
from torch import nn

from spantrain_p2p.models.example_user_model import tiny_mlp


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("this layer's backward always fails")


class FailsInBackward(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return _FailsInBackward.apply(self.inner(x))


def failing_mlp(**kwargs):
    layers = tiny_mlp(**kwargs)
    layers[1] = FailsInBackward(layers[1])
    return layers
