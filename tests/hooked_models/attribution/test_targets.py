"""Output targets beyond the salient logits (hooked_models/attribution/targets.py), feature interventions
in generation (intervention.py), and `attribute`'s progress and cancellation."""

import pytest
import torch

from hooked_models import HookedArcee
from hooked_models.attribution import CustomTarget, attribute, feature_intervention_generate
from hooked_models.progress import Cancelled


def test_a_logit_difference_is_the_difference_of_the_two_rows_and_every_target_is_complete(family_setup,
                                                                                            replacement):
    """Targets [a, b, (a, b), a direction at position 3, another at the default position (the last)]: the
    difference's row is row a less row b (1e-5 of the rows); a token's weight is its probability at the
    last position; each output's value (its direction . the logits at its position, in the replacement
    model) is the sum of its row plus its bias (every node zero), within 1e-5 of the terms."""
    model, tcs, tokens = family_setup
    vocab = model.cfg.vocab_size
    direction = torch.randn(vocab, generator=torch.Generator().manual_seed(7))
    last = torch.randn(vocab, generator=torch.Generator().manual_seed(8))
    a, b = 3, 11
    graph = attribute(model, tokens, tcs, targets=[a, b, (a, b), CustomTarget("d", direction, pos=3, weight=0.5),
                                                   CustomTarget("last", last)], head_loadings=False, batch_size=8)
    assert graph.n_logits == 5 and graph.logit_tokens.tolist() == [a, b, -1, -2, -3]
    rows = graph.adjacency_matrix[graph.logit_start:]
    scale = float(rows[:2].abs().max())
    assert (rows[2] - (rows[0] - rows[1])).abs().max() <= 1e-5 * scale
    assert graph.node_position(graph.logit_start + 3) == (graph.n_layers, 3)
    assert graph.node_position(graph.logit_start + 4) == (graph.n_layers, len(tokens) - 1)  # pos=-1: the last
    assert graph.logit_probabilities.tolist()[2:] == [1.0, 0.5, 1.0]
    with torch.no_grad():
        probabilities = torch.softmax(model(tokens[None])[0, -1].double(), -1)
    assert graph.logit_probabilities[:2].tolist() == pytest.approx(probabilities[[a, b]].tolist(), rel=1e-5)

    oracle = replacement(model, tcs, tokens)
    clean, zero = oracle.run(), oracle.run(zero_sources=True)
    one_hot = torch.eye(vocab)
    directions = [(one_hot[a] - 1 / vocab, -1), (one_hot[b] - 1 / vocab, -1), (one_hot[a] - one_hot[b], -1),
                  (direction, 3), (last, -1)]
    for k, (d, pos) in enumerate(directions):
        value, bias = float(d @ clean.raw[pos]), float(d @ zero.raw[pos])
        gap = abs(value - float(rows[k].sum()) - bias) / (float(rows[k].abs().sum()) + abs(bias))
        assert gap < 1e-5, (k, gap)


def test_targets_named_by_strings_on_the_embedded_model(make_untied):
    model = HookedArcee.from_pretrained("embedded").eval()
    tcs = make_untied(model)
    prompt = "When Mary and John went to the store John gave a drink to"
    graph = attribute(model, prompt, tcs, targets=[(" Mary", " John"), " Mary"], head_loadings=False)
    assert graph.logit_str_tokens == [" Mary -  John", " Mary"]
    assert graph.logit_tokens[1] == model.to_single_token(" Mary")
    assert graph.node_name(graph.logit_start).startswith("target.")
    with pytest.raises(ValueError, match="' Mary John' is not one token"):
        attribute(model, prompt, tcs, targets=[" Mary John"], head_loadings=False)
    with pytest.raises(ValueError, match="direction of shape"):
        attribute(model, prompt, tcs, targets=[CustomTarget("short", torch.ones(3))], head_loadings=False)
    # One node per token (its node_id is the token's): a token named twice, by id or by text, is refused.
    mary = model.to_single_token(" Mary")
    for twice in ([3, 3], [" Mary", mary]):
        with pytest.raises(ValueError, match=rf"targets name token {twice[-1]} \(.*\) twice: give each token once"):
            attribute(model, prompt, tcs, targets=twice, head_loadings=False)


def test_progress_names_each_phase_and_cancelling_stops_with_no_hook_left(family_setup):
    model, tcs, tokens = family_setup
    with torch.no_grad():
        before = model(tokens[None])
    steps = []
    attribute(model, tokens, tcs, batch_size=8, progress=steps.append)
    phases = [s.phase for s in steps]
    assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] == [
        "logits", "features", "gradients", "decomposition"]
    assert all(s.done <= s.total for s in steps) and steps[-1].done == steps[-1].total

    def cancel(step):
        if step.phase == "features" and step.done:
            raise Cancelled("stop")

    with pytest.raises(Cancelled):
        attribute(model, tokens, tcs, batch_size=8, progress=cancel)
    assert not any(hp._forward_hooks for hp in model.hook_dict.values())
    with torch.no_grad():
        assert torch.equal(model(tokens[None]), before)


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_generation_with_a_feature_clamped(family, tl_model_factory, make_untied):
    """Without interventions, the model's own greedy continuation; with a last-layer feature clamped at a
    prompt position and at a new one (nothing after it reads features), the continuation of the model
    with that feature's decoder row added there, times the change: an oracle through a plain hook."""
    model = tl_model_factory(family)
    tcs = make_untied(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(4))
    new = 8
    plain = model.generate(tokens[None], max_new_tokens=new, do_sample=False, use_cache=False, verbose=False)[0]
    assert torch.equal(feature_intervention_generate(model, tokens, tcs, [], max_new_tokens=new), plain)

    last = tcs.n_layers - 1
    feature, value = 5, 8.0
    clamps = [(last, 2, feature, value), (last, 10, feature, value)]
    got = feature_intervention_generate(model, tokens, tcs, clamps, max_new_tokens=new)

    def shift(t, hook):
        x = live["x"]
        a = tcs[last].encode(x)[..., feature]
        out = t.clone()
        for pos in (2, 10):
            if pos < t.shape[1]:
                out[:, pos] += (value - a[:, pos, None]) * tcs[last].W_dec[feature]
        return out

    live = {}
    hooks = [(tcs.input_hook(last), lambda t, hook: live.__setitem__("x", t)), (tcs.output_hook(last), shift)]
    expected = model.generate(tokens[None], max_new_tokens=new, do_sample=False, use_cache=False, verbose=False,
                              fwd_hooks=hooks)[0]
    assert torch.equal(got, expected)
    assert not torch.equal(got, plain)  # the clamp changes the continuation
    with pytest.raises(ValueError, match="position"):
        feature_intervention_generate(model, tokens, tcs, [(0, -1, 0, 1.0)])
