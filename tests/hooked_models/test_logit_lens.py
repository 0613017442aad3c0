"""The package's logit lens (what `cache.logit_lens` is on TransformerLens 3.x), on both families:
every entry is the model's own readout of that stream (`start_at_layer=num_layers` runs the final norm
and the head only), and on TransformerLens 4.x it agrees with TransformerLens's own lens."""

import pytest
import torch

from hooked_models.logit_lens import logit_lens
from hooked_models.transformer_lens_compat import TRANSFORMER_LENS_4

close = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def run(tl_model):
    tokens = torch.randint(0, tl_model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = tl_model.run_with_cache(tokens)
    return tl_model, logits, cache


def readout(model, stream):
    """The model's own logits for a residual stream entering the final norm."""
    with torch.no_grad():
        return model(stream, start_at_layer=model.cfg.n_layers)


def test_every_entry_is_the_models_readout_of_that_stream(run):
    model, logits, cache = run
    n = model.cfg.n_layers
    lens = logit_lens(cache, positions=None, incl_mid=True)
    streams = [s for layer in range(n) for s in (cache["resid_pre", layer], cache["resid_mid", layer])]
    streams.append(cache["resid_post", n - 1])
    assert lens.labels == [f"{i}_{k}" for i in range(n) for k in ("pre", "mid")] + ["final_post"]
    for entry, stream in zip(lens.values, streams, strict=True):
        torch.testing.assert_close(entry, readout(model, stream), **close)
    torch.testing.assert_close(lens.values[-1], logits, **close)


def test_selections_and_return_types(run):
    model, _, cache = run
    full = logit_lens(cache)  # the last position of every entry
    assert full.values.shape == (model.cfg.n_layers + 1, 2, model.cfg.d_vocab)
    log_probs = logit_lens(cache, return_type="log_probs").values
    torch.testing.assert_close(log_probs, full.values.log_softmax(-1), **close)
    torch.testing.assert_close(logit_lens(cache, return_type="probs").values, log_probs.exp(), **close)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(full.readout.entropy, entropy, **close)

    top = logit_lens(cache, top_k=3, layers=[0, -1], batch_slice=1)
    expected = full.values[[0, -1], 1].topk(3, dim=-1)
    assert torch.equal(top.readout.top_ids, expected.indices) and not top.has_batch_dim
    torch.testing.assert_close(top.values, expected.values, **close)
    assert top.labels == [full.labels[0], full.labels[-1]]

    shared = logit_lens(cache, targets=[4, 9])
    torch.testing.assert_close(shared.values, full.values[..., [4, 9]], **close)
    ranks = (full.values > full.values[..., 9:10]).sum(-1)
    assert torch.equal(shared.rank_trajectory(9), ranks)
    assert torch.equal(logit_lens(cache, vocab=[9]).values[..., 0], full.values[..., 9])

    per_row = logit_lens(cache, targets=torch.tensor([5, 7]))  # one per example (last position)
    torch.testing.assert_close(per_row.values[..., 0], full.values[:, [0, 1], [5, 7]], **close)
    ranks = (full.values > full.values[:, [0, 1], [5, 7]][..., None]).sum(-1)
    assert torch.equal(per_row.rank_trajectory(), ranks)


def test_a_lens_translator_and_the_errors(run):
    model, _, cache = run
    doubled = logit_lens(cache, lens=lambda entry, index: 2 * entry, positions=None)
    torch.testing.assert_close(doubled.values[0], readout(model, 2 * cache["resid_pre", 0]), **close)
    with pytest.raises(ValueError, match="at most one of"):
        logit_lens(cache, top_k=2, targets=3)
    with pytest.raises(ValueError, match="out of range"):
        logit_lens(cache, layers=[model.cfg.n_layers + 1])
    with pytest.raises(ValueError, match=r"within \[0, "):
        logit_lens(cache, targets=model.cfg.d_vocab)
    with pytest.raises(ValueError, match="return_type"):
        logit_lens(cache, return_type="odds")
    model.train()
    with pytest.raises(ValueError, match="evaluation mode"):
        logit_lens(cache)
    model.eval()


@pytest.mark.skipif(not TRANSFORMER_LENS_4, reason="TransformerLens's own logit lens is new in 4.x")
def test_agrees_with_transformer_lens_4s_lens(run):
    _, _, cache = run
    for kwargs in (dict(positions=None, incl_mid=True), dict(top_k=4), dict(targets=[3, 6], return_type="log_probs")):
        ours, theirs = logit_lens(cache, **kwargs), cache.logit_lens(**kwargs)
        assert ours.labels == theirs.labels
        torch.testing.assert_close(ours.values, theirs.values, **close)
        for field in ("top_ids", "target_ranks"):
            assert (getattr(ours.readout, field) is None) == (getattr(theirs.readout, field) is None)
            if getattr(ours.readout, field) is not None:
                assert torch.equal(getattr(ours.readout, field), getattr(theirs.readout, field))
