"""The written-out backward of an Arcee's replacement model (hooked_models/attribution/linear_backward.py)
against autograd's over the frozen forward, which shares none of its arithmetic: the same rows within
float32 rounding, and within 1e-5 of the largest entry of autograd's rows on the model and transcoders in
float64; the graph `attribute` builds with it is the graph built with autograd; every model or transcoder
set it does not serve is refused with the reason, and `attribute` then takes autograd's path."""

import importlib

import pytest
import torch

from hooked_models.attribution import attribute
from hooked_models.attribution.linear_backward import LinearBackward, refusal
from hooked_models.attribution.replacement import Prompt, Replica, prompt_tokens
from hooked_models.attribution.targets import Target, target_rows
from hooked_models.transcoders import Transcoder, TranscoderSet

# The module (the package's `attribute` is the function): where attribute reads `refusal`.
attribute_module = importlib.import_module("hooked_models.attribution.attribute")


@pytest.fixture(scope="module")
def arcee(tl_model_factory):
    return tl_model_factory("arcee")  # 2 layers, 4 query heads over 2 key/value heads


def transcoders(model, skip: bool, seed: int = 0) -> TranscoderSet:
    """Random per-layer transcoders, every weight and bias drawn on its own (the skip's far from identity)."""
    d, n = model.cfg.hidden_size, model.cfg.num_layers
    tcs = TranscoderSet([Transcoder(d, 32, layer=l, skip=skip) for l in range(n)], model=model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tcs.named_parameters():
            p.copy_({"W_skip": 0.3, "b_enc": 0.3}.get(name.split(".")[-1], d**-0.5) * torch.randn(p.shape, generator=generator))
            if name.endswith("b_enc"):
                p.add_(0.2)
    return tcs


def every_target(model, state, tcs, seed: int = 1) -> list[Target]:
    """Every active feature and three logit directions (two positions), ordered by layer as attribute orders them."""
    generator = torch.Generator().manual_seed(seed)
    targets = [Target(l, p, tcs.encoder(l).detach()[:, f].to(state.errors.dtype)) for l, p, f in state.active.tolist()]
    seq, vocab = state.tokens.shape[1], model.cfg.vocab_size
    targets += [Target(None, pos, torch.randn(vocab, generator=generator).to(state.errors.dtype))
                for pos in (seq - 1, seq - 1, seq // 2)]
    return sorted(targets, key=lambda t: (model.cfg.num_layers if t.layer is None else t.layer, t.pos))


def random_prompt(model, tcs, length: int, seed: int, keep_position_zero: bool = True) -> Prompt:
    """The replacement model of a random prompt of `length` tokens."""
    ids = torch.randint(0, model.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    return Prompt(model, prompt_tokens(model, ids), tcs, keep_position_zero=keep_position_zero)


def chunks(targets: list) -> list[list]:
    """The whole list, strided subsets (layers and positions mixed), the logits alone, one feature alone."""
    return [targets, targets[::3], targets[1::5], targets[-3:], targets[len(targets) // 2:len(targets) // 2 + 1]]


@pytest.mark.parametrize("bottom", ["embedding_reads", "block"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "packed"])
@pytest.mark.parametrize("factored", [True, False], ids=["factored", "dense"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "no_skip"])
def test_the_written_out_rows_are_autograds(arcee, skip, factored, padded, bottom, monkeypatch):
    """Both ways through the block below a target's first (the factored products and the dense ones),
    both layouts of the dense ones (every position up to the chunk's last, or each target's own,
    packed), and both ways through the bottom block (its dots with the embedding from
    `_embedding_reads`' columns, or the block's products then the dots)."""
    monkeypatch.setattr(LinearBackward, "_factors_pay", lambda self, position, first: factored)
    monkeypatch.setattr(LinearBackward, "_padding_pays", staticmethod(lambda position, n, first: padded))
    monkeypatch.setattr(LinearBackward, "_reads_pay", lambda self: bottom == "embedding_reads")
    tcs = transcoders(arcee, skip)
    state = random_prompt(arcee, tcs, 11, 5, keep_position_zero=False)
    assert refusal(arcee, tcs) is None
    written, autograd = LinearBackward(state), Replica(state)
    targets = every_target(arcee, state, tcs)
    assert len({t.layer for t in targets}) == tcs.n_layers + 1 and len(targets) > 100
    assert (written._embedding_reads() is not None) == (bottom == "embedding_reads")
    for chunk in chunks(targets):
        got, expected = written.rows(chunk), target_rows(autograd, chunk)
        assert got.shape == expected.shape and expected.abs().max() > 0
        # the same sums in other orders: float32 rounding (2e-7 of the largest entry here)
        assert float((got - expected).abs().max()) <= 1e-6 * float(expected.abs().max())


@pytest.mark.parametrize("keep_position_zero", [False, True])
@pytest.mark.parametrize("factored", [True, False], ids=["factored", "dense"])
def test_the_written_out_head_gradients_are_autograds(arcee, keep_position_zero, factored, monkeypatch):
    """The gradients at every layer's head outputs (what head loadings multiply), position 0's included."""
    from hooked_models.attribution.targets import directions

    monkeypatch.setattr(LinearBackward, "_factors_pay", lambda self, position, first: factored)
    tcs = transcoders(arcee, True)
    state = random_prompt(arcee, tcs, 10, 8, keep_position_zero)
    written, autograd = LinearBackward(state), Replica(state)
    for i, chunk in enumerate(chunks(every_target(arcee, state, tcs))):
        got, expected = written.head_gradients(chunk), autograd.head_gradients(*directions(autograd, chunk))
        assert len(got) == len(expected) == arcee.cfg.num_layers
        largest = max(float(e.abs().max()) for e in expected)
        assert largest > 0 and all(g.shape == e.shape for g, e in zip(got, expected))
        assert max(float((g - e).abs().max()) for g, e in zip(got, expected)) <= 1e-6 * largest
        if i == 0:  # every target: position 0's heads below the top layer are reached too
            assert float(expected[0][:, 0].abs().max()) > 0


@pytest.mark.parametrize("bottom", ["embedding_reads", "block"])
def test_the_written_out_rows_in_float32_are_float64_autograds_within_1e_5(arcee, bottom, monkeypatch):
    """(Position 0 kept: every position carried.)"""
    monkeypatch.setattr(LinearBackward, "_reads_pay", lambda self: bottom == "embedding_reads")
    tcs = transcoders(arcee, True)
    tokens = prompt_tokens(arcee, torch.randint(0, arcee.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(6)))
    state = Prompt(arcee, tokens, tcs)
    targets = every_target(arcee, state, tcs)
    got = LinearBackward(state).rows(targets)
    model64, tcs64 = arcee.to(torch.float64), tcs.to(torch.float64)
    try:
        state64 = Prompt(model64, tokens, tcs64)
        assert torch.equal(state64.active, state.active)  # the same features, the same columns
        targets64 = every_target(model64, state64, tcs64)
        expected = target_rows(Replica(state64), targets64)
        assert refusal(model64, tcs64) is None  # float64 throughout: served too
        # within autograd's rounding: its norms' backward runs in float32 (x.float(), as their forward does)
        in64 = LinearBackward(state64).rows(targets64)
        assert float((in64 - expected).abs().max()) <= 1e-7 * float(expected.abs().max())
    finally:
        arcee.to(torch.float32)
        tcs.to(torch.float32)
    assert float((got.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


def test_attribute_builds_autograds_graph_with_it(arcee, monkeypatch):
    tcs = transcoders(arcee, True)
    tokens = torch.randint(0, arcee.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(7))
    calls, rows = [], LinearBackward.rows
    monkeypatch.setattr(LinearBackward, "rows", lambda self, *a, **kw: calls.append(1) or rows(self, *a, **kw))
    graphs = [attribute(arcee, tokens, tcs, batch_size=7, max_feature_nodes=budget, head_loadings=False)
              for budget in (None, 40)]
    assert calls
    n_calls = len(calls)
    monkeypatch.setattr(attribute_module, "refusal", lambda model, transcoders: "autograd's path, for the test")
    for graph, budget in zip(graphs, (None, 40)):
        expected = attribute(arcee, tokens, tcs, batch_size=7, max_feature_nodes=budget, head_loadings=False)
        assert torch.equal(graph.active_features, expected.active_features)
        largest = float(expected.adjacency_matrix.abs().max())
        assert float((graph.adjacency_matrix - expected.adjacency_matrix).abs().max()) <= 1e-6 * largest
    assert len(calls) == n_calls  # the forced path never called it


def test_what_it_does_not_serve_is_refused_with_the_reason(arcee, tl_model_factory):
    from hooked_models.transcoders import CrossLayerTranscoder

    tcs = transcoders(arcee, True)
    assert "HookedAlphaEr is not an Arcee model" in refusal(tl_model_factory("alpha_er"), tcs)
    clt = CrossLayerTranscoder(arcee.cfg.num_layers, arcee.cfg.hidden_size, 16, model=arcee)
    assert "CrossLayerTranscoder is not a per-layer TranscoderSet" in refusal(arcee, clt)
    assert "torch.bfloat16" in refusal(arcee, tcs.to(torch.bfloat16))
    tcs.to(torch.float32)
    with arcee.hooks(fwd_hooks=[("layers.0.layer_mid", lambda t, hook: t)]):
        assert "carries hooks" in refusal(arcee, tcs)
    assert refusal(arcee, tcs) is None
    state = Prompt(arcee, prompt_tokens(arcee, torch.arange(6)), tcs)
    targets = every_target(arcee, state, tcs)
    with pytest.raises(ValueError, match="ordered by layer"):
        LinearBackward(state).rows(targets[::-1])
