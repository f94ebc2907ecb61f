"""The reference model cuts anywhere with identical results, and its data is a pure function of the step."""
from __future__ import annotations

import math
import re

import pytest
import torch

from spantrain_p2p.data.generated import batch, corpus, global_batch
from spantrain_p2p.models.model import Block, Embedding, LMHead, ModelConfig, build_layer_range, build_layers, flops_per_layer, load_user_model, num_params

CFG = ModelConfig(dim=32, depth=3, heads=4, seq_len=16)
EXAMPLE = "spantrain_p2p.models.example_user_model:tiny_mlp"


def run_layers(layers: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for layer in layers[:-1]:
        x = layer(x)
    return layers[-1](x, y)


def states_equal(a: list[torch.nn.Module], b: list[torch.nn.Module]) -> bool:
    if len(a) != len(b):
        return False
    for la, lb in zip(a, b):
        sa, sb = la.state_dict(), lb.state_dict()
        if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return True


def test_layer_list_is_embedding_blocks_head_with_expected_shapes() -> None:
    layers = build_layers(CFG)
    assert len(layers) == CFG.depth + 2 == CFG.num_layers
    assert isinstance(layers[0], Embedding) and isinstance(layers[-1], LMHead)
    assert all(isinstance(m, Block) for m in layers[1:-1])
    assert sum(p.numel() for m in layers for p in m.parameters()) == num_params(CFG)
    x, y = batch(0, 0, 0, 3, CFG.seq_len)
    h = layers[0](x)
    assert h.shape == (3, CFG.seq_len, CFG.dim)
    for block in layers[1:-1]:
        assert block(h).shape == h.shape
    loss = layers[-1](h, y)
    assert loss.dim() == 0 and abs(loss.item() - math.log(256)) < 0.5  # near-uniform at init


def test_blocks_are_causal() -> None:
    block = build_layer_range(CFG, 1, 2)[0]
    h = torch.randn(1, CFG.seq_len, CFG.dim)
    h2 = h.clone()
    h2[:, 10:] += 1.0
    assert torch.allclose(block(h)[:, :10], block(h2)[:, :10], atol=1e-6)
    assert not torch.allclose(block(h)[:, 10:], block(h2)[:, 10:])


@pytest.mark.parametrize("first,last", [(0, 1), (1, 3), (2, 5), (4, 5), (0, 5)])
def test_layer_range_equals_slice_of_full_model(first: int, last: int) -> None:
    assert states_equal(build_layer_range(CFG, first, last), build_layers(CFG)[first:last])


def test_building_does_not_disturb_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_layers(CFG)
    assert torch.equal(torch.rand(4), expected)


def test_same_seed_builds_identical_weights_and_other_seeds_differ() -> None:
    assert states_equal(build_layers(CFG), build_layers(CFG))
    a, b = build_layers(CFG), build_layers(ModelConfig(**{**CFG.to_dict(), "seed": 1}))
    for la, lb in zip(a, b):
        for (name, pa), pb in zip(la.named_parameters(), lb.parameters()):
            if pa.std() > 0:  # every random tensor changes; LayerNorm ones and zero biases do not
                assert not torch.equal(pa, pb), name


def test_bad_layer_range_is_refused() -> None:
    for first, last in [(-1, 2), (2, 2), (3, 1), (0, CFG.num_layers + 1)]:
        with pytest.raises(ValueError):
            build_layer_range(CFG, first, last)


@pytest.mark.parametrize("cut", range(1, CFG.depth + 2))
def test_pipeline_cut_gives_same_loss_and_gradients(cut: int) -> None:
    x, y = batch(0, 3, 1, 4, CFG.seq_len)
    full = build_layers(CFG)
    loss_full = run_layers(full, x, y)
    loss_full.backward()

    front, back = build_layer_range(CFG, 0, cut), build_layer_range(CFG, cut, CFG.num_layers)
    act = x
    for layer in front:
        act = layer(act)
    sent = act.detach().requires_grad_(True)  # what crosses the wire
    loss_cut = run_layers([torch.nn.Identity(), *back], sent, y)
    loss_cut.backward()
    act.backward(sent.grad)

    assert torch.allclose(loss_full, loss_cut, atol=1e-6)
    for lf, lc in zip(full, front + back):
        for pf, pc in zip(lf.parameters(), lc.parameters()):
            assert torch.allclose(pf.grad, pc.grad, atol=1e-6)


def test_batch_is_deterministic_and_distinct_across_steps_and_micro_batches() -> None:
    x1, y1 = batch(7, 5, 2, 4, 24)
    x2, y2 = batch(7, 5, 2, 4, 24)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == y1.dtype == torch.long and x1.shape == y1.shape == (4, 24)
    for other in (batch(7, 6, 2, 4, 24)[0], batch(7, 5, 3, 4, 24)[0], batch(8, 5, 2, 4, 24)[0]):
        assert not torch.equal(x1, other)


def test_targets_are_inputs_shifted_by_one_byte() -> None:
    x, y = batch(0, 1, 0, 6, 20)
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = torch.from_numpy(corpus(0).astype("int64"))
    for row_x, row_y in zip(x, y):  # each row is a real window of the corpus
        starts = (data[: len(data) - 20] == row_x[0]).nonzero().flatten()
        assert any(torch.equal(data[s : s + 21], torch.cat([row_x, row_y[-1:]])) for s in starts.tolist())


def test_global_batch_concatenates_micro_batches_in_order() -> None:
    gx, gy = global_batch(3, 9, 3, 2, 16)
    parts = [batch(3, 9, m, 2, 16) for m in range(3)]
    assert torch.equal(gx, torch.cat([p[0] for p in parts])) and torch.equal(gy, torch.cat([p[1] for p in parts]))


def test_corpus_is_readable_text_same_per_seed() -> None:
    text = bytes(corpus(0)).decode("ascii")
    assert len(text) >= 200_000 and text.count(" ") > len(text) // 10 and "." in text
    assert bytes(corpus(0)) == text.encode() and bytes(corpus(1)) != text.encode()
    corpus.cache_clear()
    assert bytes(corpus(0)) == text.encode()  # regenerated, not just cached
    with pytest.raises(ValueError):
        corpus(0).__setitem__(0, 1)  # read-only: one caller cannot corrupt the cache


def test_bad_batch_arguments_are_refused() -> None:
    for args in [(-1, 0, 0, 2, 8), (0, -1, 0, 2, 8), (0, 0, 0, 0, 8), (0, 0, 0, 2, 10**9), (0, 0, 0, 2, 8.0)]:
        with pytest.raises(ValueError):
            batch(*args)


def test_model_config_round_trips_through_dict() -> None:
    assert ModelConfig.from_dict(CFG.to_dict()) == CFG
    want = {"vocab": 256, "dim": 32, "depth": 3, "heads": 4, "seq_len": 16, "mlp_ratio": 4, "seed": 0}
    assert CFG.to_dict() == want


@pytest.mark.parametrize(
    "change",
    [
        {"dim": "64"},
        {"dim": 64.0},
        {"depth": True},
        {"depth": -1},
        {"heads": 0},
        {"dim": 10**9},
        {"vocab": 10**12},
        {"dim": 30, "heads": 4},
        {"dim": 8192, "depth": 1024},  # each field in bounds, but ~800 G parameters
        {"seed": -3},
        {"bogus": 1},
    ],
)
def test_model_config_from_dict_rejects_bad_input(change: dict) -> None:
    with pytest.raises(ValueError):
        ModelConfig.from_dict({**CFG.to_dict(), **change})


def test_model_config_from_dict_rejects_non_maps_and_missing_fields() -> None:
    for bad in [None, [1, 2], "dim=64", {k: v for k, v in CFG.to_dict().items() if k != "dim"}, {1: 2}]:
        with pytest.raises(ValueError):
            ModelConfig.from_dict(bad)


def test_flops_per_layer_grow_with_micro_batch_and_favour_blocks() -> None:
    f1, f4 = flops_per_layer(CFG, 1), flops_per_layer(CFG, 4)
    assert len(f1) == CFG.num_layers and all(b == pytest.approx(4 * a) for a, b in zip(f1, f4))
    assert f1[1] > f1[0] and all(f > 0 for f in f1)
    with pytest.raises(ValueError):
        flops_per_layer(CFG, 0)


def test_load_user_model_loads_the_example_deterministically() -> None:
    layers = load_user_model(EXAMPLE, dim=16, depth=3, seq_len=12, seed=5)
    assert len(layers) == 5
    assert states_equal(layers, load_user_model(EXAMPLE, dim=16, depth=3, seq_len=12, seed=5))
    x, y = batch(0, 0, 0, 2, 12)
    loss = run_layers(layers, x, y)
    assert loss.dim() == 0 and loss.item() > 0


@pytest.mark.parametrize("spec", ["nomodule:fn", "os:getcwd", "os:no_such_fn", "os.path", "a:b:c", ":fn"])
def test_load_user_model_rejects_bad_specs_naming_them(spec: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(spec))):
        load_user_model(spec)


def test_tiny_model_learns_the_corpus() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, depth=2, heads=4, seq_len=32)
    layers = build_layers(cfg)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for step in range(150):
        x, y = batch(0, step, 0, 8, cfg.seq_len)
        loss = run_layers(layers, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    start, end = losses[0], sum(losses[-10:]) / 10
    print(f"loss {start:.3f} -> {end:.3f} nats over 150 steps")
    assert start - end >= 1.0
