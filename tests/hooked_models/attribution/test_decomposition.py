"""The forward decomposition of the residual stream (hooked_models/attribution/decomposition.py): every
node's contributions plus the biases are the frozen forward's values, and one node's contribution is
what the replacement model (tests/hooked_models/attribution/conftest.py) moves when it is removed."""

import torch

from hooked_models.attribution.decomposition import Component, decompose
from hooked_models.attribution.replacement import Prompt


def every_node(prompt) -> list[Component]:
    n_layers, seq = prompt.errors.shape[:2]
    return ([Component("feature", int(l), int(p), i) for i, (l, p, _) in enumerate(prompt.active.tolist())]
            + [Component("error", l, p) for l in range(n_layers) for p in range(seq)]
            + [Component("embedding", None, p) for p in range(seq)])


def reads(model) -> list[str]:
    names = []
    for l in range(model.cfg.num_layers):
        names += [f"layers.{l}.layer_input", f"layers.{l}.self_attn.attention_queries",
                  f"layers.{l}.self_attn.attention_keys", f"layers.{l}.self_attn.attention_head_outputs"]
    # The last layer's output too: a cross-layer transcoder's write to the last MLP is seen only there.
    return names + [f"layers.{model.cfg.num_layers - 1}.layer_output"]


def test_the_nodes_contributions_and_the_bias_sum_to_the_frozen_forward(family_setup):
    """Per layer and position: the residual entering the layer, the queries, keys and head outputs, as
    the model computes them with its norm scales and patterns written back (no code of the package), are
    the sum of every node's contribution plus the bias, within 1e-5 of the terms' magnitude."""
    model, tcs, tokens = family_setup
    prompt = Prompt(model, tokens[None], tcs)
    components = every_node(prompt)
    names = reads(model)
    sums, bias, total = {}, None, None  # per name: sum of |contributions|, their sum
    for chunk in decompose(prompt, components, names, batch_size=16, with_total=True):
        for name, value in chunk.values.items():
            sums[name] = sums.get(name, 0) + value.abs().sum(0)
            sums[name + "/sum"] = sums.get(name + "/sum", 0) + value.sum(0)
        bias, total = bias or chunk.bias, total or chunk.total
    with torch.no_grad():
        # The oracle: the clean run, whose values the frozen model keeps (the scales and patterns are the
        # model's own), attention explicit as any hook on the patterns makes it.
        _, explicit = model.run_with_cache(tokens[None], names_filter=lambda n: n in names or
                                           n.endswith("attention_probabilities"))
    for name in names:
        truth = explicit[name][0]
        got = sums[name + "/sum"] + bias[name]
        gap = (got - truth).abs() / (sums[name] + bias[name].abs()).clamp(min=1e-30)
        assert gap.max() < 1e-5, (name, float(gap.max()))
        assert torch.allclose(total[name], truth, rtol=1e-5, atol=1e-6 * float(truth.abs().max())), name
    assert float(bias["layers.1.layer_input"].abs().max()) > 0  # the biases are part of it (b_dec at least)


def test_one_features_contribution_is_what_removing_it_moves(family_setup, replacement):
    """The contribution of the feature with the largest write, at every later layer's input, queries and
    head outputs, equals the replacement model's values less the same model with that write taken away
    (1e-5 of the values' magnitude); at layers up to its own it is exactly zero."""
    model, tcs, tokens = family_setup
    prompt = Prompt(model, tokens[None], tcs)
    oracle = replacement(model, tcs, tokens)
    strength = prompt.activations.abs() * (prompt.active[:, 0] < tcs.n_layers - 1)  # a layer it can reach past
    i = int(strength.argmax())
    layer, pos, feature = prompt.active[i].tolist()
    names = reads(model)
    (chunk,) = decompose(prompt, [Component("feature", layer, pos, i)], names)
    write = oracle.write(layer, pos, feature)
    removed = {(t, pos): -write[t] for t in range(tcs.n_layers) if bool(write[t].any())}
    clean, without = oracle.run(names=names), oracle.run(removed, names=names)
    for name in names:
        expected = clean.values[name] - without.values[name]
        got = chunk.values[name][0]
        scale = float(clean.values[name].abs().max())
        assert (got - expected).abs().max() <= 1e-5 * scale, (name, float((got - expected).abs().max()), scale)
        if name.startswith("layers.") and int(name.split(".")[1]) <= layer:
            assert torch.equal(got, torch.zeros_like(got)), name
    assert float(chunk.values[f"layers.{layer + 1}.self_attn.attention_head_outputs"].abs().max()) > 1e-3


def test_nothing_is_computed_only_to_be_replaced_and_the_model_comes_back(family_setup):
    """The decomposition replaces every MLP's output (the transcoder's bias and skip plus the nodes'
    writes) and every pattern (the prompt's), so no MLP weight is multiplied and no score is computed
    during it (hooks on each MLP's first projection and on the scores never fire); afterwards the
    model's own forward is back, every MLP computed and the logits as before."""
    model, tcs, tokens = family_setup
    prompt = Prompt(model, tokens[None], tcs)
    with torch.no_grad():
        before = model(tokens[None])
    calls = []
    firsts = [next(m for m in layer.mlp.modules() if m is not layer.mlp and len(list(m.parameters(recurse=False))))
              for layer in model.layers]
    watched = firsts + [layer.self_attn.attention_scores for layer in model.layers]
    handles = [m.register_forward_hook(lambda *args, i=i: calls.append(i)) for i, m in enumerate(watched)]
    try:
        list(decompose(prompt, every_node(prompt)[:3], reads(model), with_total=True))
        assert calls == []
        with torch.no_grad():
            logits = model(tokens[None])
        assert set(range(model.cfg.num_layers)) <= set(calls)  # the MLPs (the scores: where not fused)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(logits, before)
    assert all(layer.self_attn.fixed_pattern is None and "forward" not in vars(layer.mlp) for layer in model.layers)


def test_the_shortcuts_change_no_bit(family_setup, monkeypatch):
    """Every value the decomposition reads is the same, bit for bit, with the MLPs and scores computed
    (the shortcuts turned off) as without."""
    import contextlib

    from hooked_models.attribution import decomposition

    model, tcs, tokens = family_setup
    prompt = Prompt(model, tokens[None], tcs)
    components = every_node(prompt)[::5]

    def run():
        return [(c.values, c.bias, c.total) for c in decompose(prompt, components, reads(model), 8, with_total=True)]

    fast = run()
    monkeypatch.setattr(decomposition, "_nothing_discarded", lambda prompt: contextlib.nullcontext())
    slow = run()
    for (values, bias, total), (values0, bias0, total0) in zip(fast, slow, strict=True):
        for got, want in ((values, values0), (bias, bias0), (total or {}, total0 or {})):
            assert got.keys() == want.keys()
            for name in got:
                assert torch.equal(got[name], want[name]), name


def test_the_others_row_is_the_sum_of_the_nodes_left_out(family_setup):
    """`others=True`: one row carrying every node's writes but the components' (a feature of each kind, an
    error and an embedding left in the components, every third node out) contributes what the nodes left
    out contribute one by one, summed: within 1e-5 of their magnitude at every value read, through the
    cross-layer decoders and every later layer."""
    model, tcs, tokens = family_setup
    prompt = Prompt(model, tokens[None], tcs)
    nodes = every_node(prompt)
    kept = [c for i, c in enumerate(nodes) if i % 3]
    left = [c for i, c in enumerate(nodes) if not i % 3]
    assert {c.kind for c in kept} == {c.kind for c in left} == {"feature", "error", "embedding"}
    names = reads(model)
    others = next(iter(decompose(prompt, kept, names, batch_size=len(kept), others=True))).others
    one_by_one = {name: 0 for name in names}
    magnitude = {name: 0 for name in names}
    for chunk in decompose(prompt, left, names, batch_size=16):
        for name, value in chunk.values.items():
            one_by_one[name] = one_by_one[name] + value.sum(0)
            magnitude[name] = magnitude[name] + value.abs().sum(0)
    for name in names:
        gap = (others[name] - one_by_one[name]).abs() / magnitude[name].clamp(min=1e-30)
        assert gap.max() < 1e-5, (name, float(gap.max()))
    assert float(others[names[-1]].abs().max()) > 0


def test_the_forward_stops_at_the_last_value_read_and_the_hooks_go(family_setup):
    """Reading only layer 0's head outputs, nothing after them runs (a hook on the last layer's input
    never fires), the values are those of a decomposition that reads the last layer too, and no hook is
    left on the model."""
    model, tcs, tokens = family_setup
    prompt = Prompt(model, tokens[None], tcs)
    components = every_node(prompt)[:4]
    name = "layers.0.self_attn.attention_head_outputs"
    full = list(decompose(prompt, components, reads(model)))[0].values[name]
    fired = []
    last = model.layers[-1]
    handle = last.register_forward_pre_hook(lambda *args: fired.append(1))
    try:
        (chunk,) = decompose(prompt, components, [name])
    finally:
        handle.remove()
    assert fired == [] and torch.equal(chunk.values[name], full)
    assert not any(point.has_hooks() for point in model.hook_dict.values())
