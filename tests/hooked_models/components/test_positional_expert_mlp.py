"""The positional expert MLP: routing, the dense neuron layout, writes that flow on, and laziness."""

import pytest
import torch
import torch.nn as nn

from hooked_models.components import AttentionInputs, PositionalExpertMLP
from hooked_models.hooks import HookWriteError

HIDDEN, EXPERTS, WIDTH = 6, 4, 5


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    module = PositionalExpertMLP(HIDDEN, EXPERTS * WIDTH, EXPERTS, nn.GELU(approximate="tanh"))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape))
    return module


def per_token(mlp: PositionalExpertMLP, x: torch.Tensor, edit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A loop over tokens, each through expert floor(t·G/T): (dense neurons, output)."""
    batch, seq, _ = x.shape
    neurons = torch.zeros(batch, seq, EXPERTS * WIDTH)
    out = torch.zeros_like(x)
    for t in range(seq):
        g = t * EXPERTS // seq
        h = mlp.act_fn(x[:, t] @ mlp.up_proj.weight[g].T)
        if edit is not None:
            h = edit(h, g, t)
        neurons[:, t, g * WIDTH:(g + 1) * WIDTH] = h
        out[:, t] = h @ mlp.down_proj.weight[g].T
    return neurons, out


@pytest.mark.parametrize("seq", [4, 12])
def test_routing_and_dense_neurons(mlp, seq):
    x = torch.randn(2, seq, HIDDEN)
    seen = {}
    mlp.mlp_neurons.add_hook(lambda t, hook: seen.update({"neurons": t}))
    mlp.mlp_expert_index.add_hook(lambda t, hook: seen.update({"experts": t}))
    out = mlp(x)
    neurons, expected = per_token(mlp, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seen["neurons"], neurons, rtol=1e-5, atol=1e-6)
    assert seen["experts"].tolist() == [[t * EXPERTS // seq for t in range(seq)]] * 2
    mlp.mlp_expert_index.remove_hooks()
    mlp.mlp_expert_index.add_hook(lambda t, hook: t + 1)
    with pytest.raises(HookWriteError, match="read-only"):
        mlp(x)


def zeroing(g: int, n: int):
    """Neuron n of expert g set to zero: (a hook on the dense neurons, the same edit for `per_token`)."""
    def hook(t, hook):
        t = t.clone()
        t[..., g * WIDTH + n] = 0.0
        return t

    def edit(h, expert, t):
        if expert == g:
            h = h.clone()
            h[:, n] = 0.0
        return h

    return hook, edit


def test_a_write_to_one_neuron_flows_on(mlp):
    x = torch.randn(1, 8, HIDDEN)
    zero, zero_ref = zeroing(2, 3)
    mlp.mlp_neurons.add_hook(zero)
    edited = mlp(x)
    _, expected = per_token(mlp, x, zero_ref)
    torch.testing.assert_close(edited, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(edited, per_token(mlp, x)[1], atol=1e-4)


def test_writes_outside_the_tokens_expert_are_not_read(mlp):
    x = torch.randn(1, 8, HIDDEN)
    clean = mlp(x)
    routed = PositionalExpertMLP.densify(torch.ones(1, EXPERTS, 2, WIDTH)).bool()
    mlp.mlp_pre_activation.add_hook(lambda t, hook: torch.where(routed, t, torch.full_like(t, 9.0)))
    mlp.mlp_activation.add_hook(lambda t, hook: torch.where(routed, t, torch.full_like(t, -5.0)))
    torch.testing.assert_close(mlp(x), clean)


def test_pre_activation_write_reaches_the_activation(mlp):
    x = torch.randn(1, 4, HIDDEN)
    seen = {}
    mlp.mlp_pre_activation.add_hook(lambda t, hook: t * 2)
    mlp.mlp_activation.add_hook(lambda t, hook: seen.update({"act": t}))
    out = mlp(x)
    pre = torch.stack([x[0, t] @ mlp.up_proj.weight[t].T for t in range(4)])  # one token per expert
    torch.testing.assert_close(seen["act"][0].view(4, EXPERTS, WIDTH).diagonal().T, mlp.act_fn(2 * pre))
    assert out.shape == x.shape


def test_the_dense_form_is_built_only_when_hooked(mlp, monkeypatch):
    x = torch.randn(1, 4, HIDDEN)

    def refuse(*args):
        raise AssertionError("densify called without a hook")

    monkeypatch.setattr(PositionalExpertMLP, "densify", staticmethod(refuse))
    mlp(x)
    mlp.mlp_neurons.add_hook(lambda t, hook: None)
    with pytest.raises(AssertionError, match="densify called"):
        mlp(x)


def test_length_must_split_into_experts(mlp):
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of the MLP's 4 experts"):
        mlp(torch.randn(1, 6, HIDDEN))
    # A window's length is the whole sequence's, cached positions included.
    with pytest.raises(ValueError, match="sequence length 10 is not a multiple of the MLP's 4 experts"):
        mlp(torch.randn(1, 8, HIDDEN), AttentionInputs(window=(2, 10)))


@pytest.mark.parametrize("seq", [8, 12])
def test_a_window_routes_by_absolute_position(mlp, seq):
    """Positions start ... of a length-seq sequence (the earlier ones in a key/value cache) go to the
    experts the whole sequence gives them, windows that start or end inside an expert's included;
    the hooks see the window's own positions, and a write there flows on."""
    x = torch.randn(2, seq, HIDDEN)
    neurons, expected = per_token(mlp, x)
    write, edit = zeroing(2, 3)  # a neuron of the expert that owns the positions from seq/2 on
    _, zeroed = per_token(mlp, x, edit)
    for start in range(seq):
        seen = {}
        mlp.mlp_neurons.add_hook(lambda t, hook: seen.update({"neurons": t}))
        mlp.mlp_expert_index.add_hook(lambda t, hook: seen.update({"experts": t}))
        out = mlp(x[:, start:], AttentionInputs(window=(start, seq)))
        torch.testing.assert_close(out, expected[:, start:], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(seen["neurons"], neurons[:, start:], rtol=1e-5, atol=1e-6)
        assert seen["experts"].tolist() == [[t * EXPERTS // seq for t in range(start, seq)]] * 2
        mlp.mlp_neurons.remove_hooks()
        mlp.mlp_expert_index.remove_hooks()
        mlp.mlp_activation.add_hook(write)
        torch.testing.assert_close(mlp(x[:, start:], AttentionInputs(window=(start, seq))), zeroed[:, start:],
                                   rtol=1e-5, atol=1e-6)
        mlp.mlp_activation.remove_hooks()


@pytest.mark.parametrize("experts", [2, 16])
def test_experts_are_one_batched_contraction_each_way(experts):
    """As the reference computes them: one contraction up and one down for all experts together,
    whatever their number (a loop over experts would show G matrix products each way)."""
    module = PositionalExpertMLP(HIDDEN, experts * WIDTH, experts, nn.GELU(approximate="tanh"))
    products = {"aten::bmm", "aten::mm", "aten::matmul", "aten::einsum", "aten::linear"}
    with torch.no_grad(), torch.profiler.profile() as profile:
        module(torch.randn(2, experts * 3, HIDDEN))
    counts = {e.key: e.count for e in profile.key_averages() if e.key in products}
    assert counts.get("aten::einsum") == 2 and counts.get("aten::bmm", 0) <= 2 and "aten::mm" not in counts, counts
