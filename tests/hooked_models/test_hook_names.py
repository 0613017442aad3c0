"""hook_dict answers to both names; per-head results are cached on request, as in TransformerLens."""

import pytest
import torch

from hooked_models import HookedArcee


@pytest.fixture(scope="module")
def embedded():
    from hooked_models.embedded.task import make_ioi_prompts

    return HookedArcee.from_pretrained("embedded"), make_ioi_prompts(2, seed=3)


def test_hook_dict_holds_each_point_under_both_names(tiny_arcee):
    z = [n for n in tiny_arcee.hook_dict if n.endswith("hook_z")]  # a TransformerLens idiom
    assert z == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    assert tiny_arcee.hook_dict["blocks.1.attn.hook_z"] is tiny_arcee.hook_dict["layers.1.self_attn.attention_head_outputs"]
    assert set(tiny_arcee.standard_hook_dict) == set(tiny_arcee.hook_dict) - set(tiny_arcee.aliases)
    # One HookPoint per value: iterating hook_dict's values repeats points, standard_hook_dict does not.
    assert len({id(p) for p in tiny_arcee.hook_dict.values()}) == len(tiny_arcee.standard_hook_dict)


def test_cache_everything_leaves_per_head_values_to_request(tiny_arcee):
    ids = torch.randint(0, 97, (1, 6))
    _, cache = tiny_arcee.run_with_cache(ids)
    assert "layers.0.self_attn.attention_head_results" not in cache.cache_dict
    assert "layers.0.self_attn.attention_head_outputs" in cache.cache_dict
    _, asked = tiny_arcee.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_result"))
    assert set(asked.cache_dict) == {"layers.0.self_attn.attention_head_results",
                                     "layers.1.self_attn.attention_head_results"}
    # Each TransformerLens switch brings its own values into a cache-everything run, and only those.
    switches = {"set_use_attn_result": ("attention_head_results",),
                "set_use_split_qkv_input": ("attention_query_inputs", "attention_key_inputs", "attention_value_inputs"),
                "set_use_attn_in": ("attention_inputs",),
                "set_use_hook_mlp_in": ("mlp_residual_input",)}
    for switch, values in switches.items():
        getattr(tiny_arcee, switch)(True)
        try:
            _, with_switch = tiny_arcee.run_with_cache(ids)
        finally:
            getattr(tiny_arcee, switch)(False)
        added = set(with_switch.cache_dict) - set(cache.cache_dict)
        assert added == {f"layers.{i}.{'' if v.startswith('mlp') else 'self_attn.'}{v}" for i in (0, 1) for v in values}
    for switch in switches:
        getattr(tiny_arcee, switch)(True)
    try:
        _, everything = tiny_arcee.run_with_cache(ids)
    finally:
        for switch in switches:
            getattr(tiny_arcee, switch)(False)
    assert set(everything.cache_dict) == set(tiny_arcee.standard_hook_dict)
    torch.testing.assert_close(everything["blocks.1.attn.hook_result"].sum(-2),
                               everything["blocks.1.hook_attn_out"], rtol=1e-5, atol=1e-6)



def test_a_value_left_out_says_what_would_cache_it(tiny_arcee):
    """A plain run_with_cache leaves hook_result out (no names_filter was given): the error names the
    switch and the name to ask for, and says nothing of a filter; with a filter, it names the filter."""
    ids = torch.randint(0, 97, (1, 6))
    _, cache = tiny_arcee.run_with_cache(ids)
    for name, switch in [("blocks.0.attn.hook_result", "set_use_attn_result"),
                         ("layers.1.mlp_residual_input", "set_use_hook_mlp_in"),
                         ("blocks.0.attn.hook_q_input", "set_use_split_qkv_input")]:
        with pytest.raises(KeyError) as info:
            cache[name]
        message = str(info.value)
        assert f"model.{switch}(True)" in message and f"names_filter=[{name!r}]" in message, message
        assert "names_filter that excludes" not in message and "names_filter given" not in message
        getattr(tiny_arcee, switch)(True)
        try:
            assert name in tiny_arcee.run_with_cache(ids)[1]
        finally:
            getattr(tiny_arcee, switch)(False)
        assert name in tiny_arcee.run_with_cache(ids, names_filter=[name])[1]
    _, filtered = tiny_arcee.run_with_cache(ids, names_filter=["blocks.0.hook_resid_pre"])
    with pytest.raises(KeyError, match=r"The names_filter given leaves it out: name it there \('blocks.0.attn.hook_z'\)"):
        filtered["blocks.0.attn.hook_z"]
    with pytest.raises(KeyError, match=r"incl_bwd=True"):
        cache["blocks.0.hook_resid_pre_grad"]

def test_transformer_lens_attribution_patch_runs_and_is_right(embedded):
    """transformer_lens.tools' attribution_patch finds our hooks through hook_dict, and its node scores
    are (clean - corrupt) · d metric / d activation, computed here by hand through the standard names."""
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    model, prompts = embedded
    clean, corrupt = prompts.clean_tokens[:1], prompts.corrupted_tokens[:1]
    correct, incorrect = int(prompts.correct[0]), int(prompts.incorrect[0])

    def metric(logits):
        return logits[0, -1, correct] - logits[0, -1, incorrect]

    result = attribution_patch(model, clean, corrupt, metric)
    _, clean_cache = model.run_with_cache(clean)
    live = {}

    def keep(t, hook):
        live[hook.name] = t

    with model.hooks(fwd_hooks=[("layers.1.self_attn.attention_head_outputs", keep)]):
        score = metric(model(corrupt))
    (grad,) = torch.autograd.grad(score, live["layers.1.self_attn.attention_head_outputs"])
    delta = clean_cache["layers.1.self_attn.attention_head_outputs"] - live["layers.1.self_attn.attention_head_outputs"]
    by_hand = (delta * grad).sum(-1)[0].detach()  # [pos head]
    scores = {(n.position, n.head): s for n, s in result.node_scores.items()
              if n.kind == "attn_head_out" and n.layer == 1}
    assert len(scores) == by_hand.numel()
    for (pos, head), s in scores.items():
        assert s == pytest.approx(float(by_hand[pos, head]), rel=1e-4, abs=1e-5)
    assert max(abs(s) for s in scores.values()) > 1e-3  # the edit matters somewhere: the test can fail


# ----------------------------------------------------------------------------------- filters on names
def _ids():
    return torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))


EXCLUDING = {  # leave the scores and the pattern out, written in either naming
    "standard": lambda n: not n.endswith(("attention_scores", "attention_probabilities")),
    "TransformerLens": lambda n: not n.endswith(("hook_attn_scores", "hook_pattern")),
}


@pytest.mark.parametrize("naming", list(EXCLUDING))
def test_an_excluding_filter_in_either_naming_keeps_the_run_on_the_fused_path(tiny_arcee, explicit_attention, naming):
    ids = _ids()
    with torch.no_grad():
        logits, cache = tiny_arcee.run_with_cache(ids, names_filter=EXCLUDING[naming])
        fused, explicit = tiny_arcee(ids), tiny_arcee.run_with_hooks(ids, fwd_hooks=explicit_attention)
    left_out = {n for n in tiny_arcee.standard_hook_dict if n.endswith(("attention_scores", "attention_probabilities"))}
    on_request = {n for n in tiny_arcee.standard_hook_dict if n.endswith("attention_head_results")}
    assert set(cache.cache_dict) == set(tiny_arcee.standard_hook_dict) - left_out
    assert on_request <= set(cache.cache_dict)  # a filter that accepts them asks for them
    assert not torch.equal(fused, explicit)  # the paths round differently, so the check below can fail
    assert torch.equal(logits, fused)
    seen = []
    with torch.no_grad():
        tiny_arcee.run_with_hooks(ids, fwd_hooks=[(EXCLUDING[naming], lambda t, hook: seen.append(hook.name))])
    assert seen and not [n for n in seen if "attention_scores" in n or "probabilities" in n or "pattern" in n]


INCLUDING = {  # the per-head outputs, named in either naming, or in both
    "standard": lambda n: n.endswith(".attention_head_outputs"),
    "TransformerLens": lambda n: n.endswith("hook_z"),
    "both": lambda n: n.endswith("hook_z") or n.endswith(".attention_head_outputs"),
}


@pytest.mark.parametrize("naming", list(INCLUDING))
def test_an_including_filter_in_either_naming_selects_the_value(tiny_arcee, naming):
    _, cache = tiny_arcee.run_with_cache(_ids(), names_filter=INCLUDING[naming])
    assert set(cache.cache_dict) == {"layers.0.self_attn.attention_head_outputs",
                                     "layers.1.self_attn.attention_head_outputs"}
    _, mixed = tiny_arcee.run_with_cache(_ids(), names_filter=lambda n: n.endswith(("hook_z", ".layer_input")))
    assert set(mixed.cache_dict) == {f"layers.{i}.{v}" for i in (0, 1)
                                     for v in ("self_attn.attention_head_outputs", "layer_input")}


def test_a_hook_added_by_a_transformer_lens_filter_sees_its_name_and_layout(tiny_arcee):
    seen = {}
    with torch.no_grad():
        tiny_arcee.run_with_hooks(_ids(), fwd_hooks=[(lambda n: n.endswith("hook_z"),
                                                     lambda t, hook: seen.update({hook.name: t.shape}))])
    cfg = tiny_arcee.cfg
    assert seen == {f"blocks.{i}.attn.hook_z": (2, 24, cfg.n_heads, cfg.d_head) for i in (0, 1)}
