"""SAE splicing (hooked_models/saes.py) with a plain encode/decode module, on both families: the splice
equals the same SAE applied by a `run_with_hooks` hook written here, the error term leaves every value
bit for bit as it was while the features stay readable and patchable, and `reset_saes` restores the
model exactly. SAELens's own SAEs are tested in test_saes_sae_lens.py (the SAE environment)."""

import pytest
import torch
import torch.nn as nn
from transformer_lens.hook_points import HookPoint

from hooked_models.hooks import ValueHook


class PlainSAE(nn.Module):
    """What SAELens's StandardSAE computes, written out: relu((x - b_dec) W_enc + b_enc) W_dec + b_dec."""

    def __init__(self, d_in: int, d_sae: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in**0.5)
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae**0.5)
        self.b_enc = nn.Parameter(0.1 * torch.randn(d_sae, generator=g))
        self.b_dec = nn.Parameter(0.1 * torch.randn(d_in, generator=g))

    def encode(self, x):
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, acts):
        return acts @ self.W_dec + self.b_dec


class HookedPlainSAE(PlainSAE):
    """PlainSAE with HookPoints of its own, fired inside encode and decode where SAELens's SAEs fire theirs:
    the splice must use them as the SAE's hooks and turn them off for the clean reconstruction."""

    def __init__(self, d_in: int, d_sae: int, seed: int = 0):
        super().__init__(d_in, d_sae, seed)
        self.hook_sae_input, self.hook_sae_acts_pre = HookPoint(), HookPoint()
        self.hook_sae_acts_post, self.hook_sae_recons = HookPoint(), HookPoint()

    def encode(self, x):
        pre = self.hook_sae_acts_pre((self.hook_sae_input(x) - self.b_dec) @ self.W_enc + self.b_enc)
        return self.hook_sae_acts_post(torch.relu(pre))

    def decode(self, acts):
        return self.hook_sae_recons(acts @ self.W_dec + self.b_dec)


class Truncating(nn.Module):
    """An 'SAE' that declares no width and reconstructs one feature too few."""

    def encode(self, x):
        return x

    def decode(self, acts):
        return acts[..., :-1]


# Values named either way, with a head axis or without; (name, its width as an SAE reads it).
NAMES = ["layers.1.layer_output", "blocks.1.hook_resid_pre", "blocks.0.hook_mlp_out", "blocks.0.mlp.hook_post",
         "blocks.1.attn.hook_z", "blocks.0.attn.hook_v", "layers.0.self_attn.attention_values", "blocks.1.attn.hook_q",
         "layers.1.self_attn.attention_keys"]


def width(model, name):
    """The SAE width of a value: its TransformerLens layout with every axis after the position flattened."""
    sizes = {"hidden_size": model.cfg.d_model, "intermediate_size": model.cfg.d_mlp}
    canonical, _ = model.resolve_hook_name(name)
    dims = model.standard_hook_dict[canonical].value.dims[1:]
    dims = [d for d in dims if d not in ("seq",)]
    n = 1
    for d in dims:
        n *= sizes.get(d) or getattr(model.cfg, d)
    return n


def reference_splice(sae):
    """The SAE applied by a plain hook on the TransformerLens name (its layout, heads flattened)."""
    def hook(value, hook):
        return sae.decode(sae.encode(value.flatten(2))).reshape(value.shape)
    return hook


def tl_name(model, name):
    canonical, _ = model.resolve_hook_name(name)
    return model.hook_names(canonical)[-1]


@pytest.fixture
def tokens(tl_model):
    return torch.randint(0, tl_model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", NAMES)
def test_splice_equals_a_run_with_hooks_splice(tl_model, tokens, name):
    model = tl_model
    sae = PlainSAE(width(model, name), 12)
    with torch.no_grad():
        spliced = model.run_with_saes(tokens, saes={name: sae})
        reference = model.run_with_hooks(tokens, fwd_hooks=[(tl_name(model, name), reference_splice(sae))])
        base = model(tokens)
    torch.testing.assert_close(spliced, reference, rtol=0, atol=0)
    assert not torch.equal(spliced, base)  # the SAE changed what the model computed
    assert model.acts_to_saes == {}


@pytest.mark.parametrize("name", NAMES)
def test_error_term_leaves_every_value_bit_for_bit_and_reads_the_features(tl_model, tokens, name):
    model = tl_model
    sae = PlainSAE(width(model, name), 12)
    canonical, _ = model.resolve_hook_name(name)
    with torch.no_grad():
        base, base_cache = model.run_with_cache(tokens)
        logits, cache = model.run_with_cache_with_saes(tokens, saes={name: sae}, use_error_term=True)
    assert torch.equal(logits, base)
    for key, value in base_cache.cache_dict.items():
        assert torch.equal(cache.cache_dict[key], value), key
    value = base_cache[tl_name(model, name)].flatten(2)  # [batch pos d_in]
    acts = sae.encode(value)
    recons = sae.decode(acts)
    for key in (canonical, tl_name(model, name)):
        torch.testing.assert_close(cache[f"{key}.hook_sae_input"], value, rtol=0, atol=0)
        torch.testing.assert_close(cache[f"{key}.hook_sae_acts_post"], acts, rtol=0, atol=0)
        torch.testing.assert_close(cache[f"{key}.hook_sae_recons"], recons, rtol=0, atol=0)
        torch.testing.assert_close(cache[f"{key}.hook_sae_error"], value - recons, rtol=0, atol=0)
        torch.testing.assert_close(cache[f"{key}.hook_sae_output"], value, rtol=0, atol=0)
    assert bool((acts > 0).any()) and bool((acts == 0).any())


@pytest.mark.parametrize("sae_class", [PlainSAE, HookedPlainSAE])
def test_patching_a_feature_moves_the_output_by_its_reconstruction(tl_model, tokens, sae_class):
    model = tl_model
    name = "blocks.1.hook_resid_pre"
    sae = sae_class(width(model, name), 12)
    plain = PlainSAE(width(model, name), 12)  # the same weights, no hooks: the edit's effect computed apart
    feature = int(plain.encode(model.run_with_cache(tokens)[1][name]).sum((0, 1)).argmax())

    def ablate(acts, hook):
        acts = acts.clone()
        acts[..., feature] = 0
        return acts

    def reference(value, hook):
        acts = plain.encode(value)
        return value - (plain.decode(acts) - plain.decode(ablate(acts, hook)))

    with torch.no_grad():
        patched = model.run_with_hooks_with_saes(tokens, saes={name: sae}, use_error_term=True,
                                                 fwd_hooks=[(f"{name}.hook_sae_acts_post", ablate)])
        expected = model.run_with_hooks(tokens, fwd_hooks=[(name, reference)])
    torch.testing.assert_close(patched, expected, rtol=0, atol=0)
    assert not torch.equal(patched, model(tokens))


def test_gradients_reach_the_features_through_the_error_term(tl_model, tokens):
    """d metric / d features = (d metric / d value) W_dec.T: the error term is constant."""
    model = tl_model
    name = "layers.1.layer_output"
    sae = PlainSAE(width(model, name), 12)
    grads = {}

    def keep(grad, hook):
        grads[hook.name] = grad

    model.add_hook(name, keep, dir="bwd")
    model(tokens)[:, -1, 3].sum().backward()
    model.reset_hooks()
    with model.saes(saes={name: sae}, use_error_term=True):
        model.add_hook(f"{name}.hook_sae_acts_post", keep, dir="bwd")
        model(tokens)[:, -1, 3].sum().backward()
        model.reset_hooks()
    torch.testing.assert_close(grads[f"{name}.hook_sae_acts_post"], grads[name] @ sae.W_dec.detach().T,
                               rtol=1e-5, atol=1e-6)


def test_reset_restores_the_model_bit_for_bit(tl_model, tokens):
    model = tl_model
    seen = []
    model.add_hook("layers.0.layer_output", lambda t, hook: seen.append(t.detach()), is_permanent=True)
    before = dict(state=model.state_dict(), modules=[n for n, _ in model.named_modules()], printed=repr(model),
                  hooks=list(model.hook_dict), aliases=dict(model.aliases), logits=model(tokens).detach())
    value = seen[-1]
    seen.clear()
    sae = PlainSAE(width(model, "layers.0.layer_output"), 12)
    model.add_sae(sae, "blocks.0.hook_resid_post")
    model.add_sae(PlainSAE(width(model, "blocks.1.attn.hook_z"), 8), "blocks.1.attn.hook_z")
    assert set(model.acts_to_saes) == {"layers.0.layer_output", "layers.1.self_attn.attention_head_outputs"}
    assert model.hook_dict["blocks.0.hook_resid_post.hook_sae_acts_post"] is \
        model.hook_dict["layers.0.layer_output.hook_sae_acts_post"]
    assert "spliced: PlainSAE" in repr(model.layers[0].layer_output)
    with torch.no_grad():
        assert not torch.equal(model(tokens), before["logits"])
    # A hook on the value sees what flows on: the SAE's output.
    torch.testing.assert_close(seen[-1], sae.decode(sae.encode(value)), rtol=0, atol=0)
    model.reset_saes("layers.1.self_attn.attention_head_outputs")
    assert list(model.acts_to_saes) == ["layers.0.layer_output"]
    model.reset_saes()
    assert model.acts_to_saes == {}
    state = model.state_dict()
    assert list(state) == list(before["state"]) and all(torch.equal(state[k], v) for k, v in before["state"].items())
    assert [n for n, _ in model.named_modules()] == before["modules"] and repr(model) == before["printed"]
    assert list(model.hook_dict) == before["hooks"] and model.aliases == before["aliases"]
    seen.clear()
    assert torch.equal(model(tokens), before["logits"])
    assert len(seen) == 1  # the permanent hook still fires, on the unspliced value
    model.reset_hooks(including_permanent=True)


def test_saes_context_restores_what_was_there(tl_model, tokens):
    model = tl_model
    name = "layers.1.layer_output"
    first, second = PlainSAE(width(model, name), 12, seed=1), PlainSAE(width(model, name), 12, seed=2)
    with torch.no_grad():
        with_first = model.run_with_saes(tokens, saes={name: first})
        with_second = model.run_with_saes(tokens, saes={name: second})
        model.add_sae(first, name)
        with model.saes(saes={"blocks.1.hook_resid_post": second}):
            assert model.acts_to_saes[name] is second
            assert torch.equal(model(tokens), with_second)
        assert model.acts_to_saes[name] is first and torch.equal(model(tokens), with_first)
        with pytest.raises(RuntimeError, match="inside"):
            with model.saes(saes={name: second}):
                raise RuntimeError("inside")
        assert model.acts_to_saes[name] is first
        model.reset_saes()


def test_a_value_cached_with_pos_slice_slices_the_saes_too(tl_model, tokens):
    model = tl_model
    name = "layers.1.layer_output"
    sae = PlainSAE(width(model, name), 12)
    selected = lambda n: n.startswith("blocks.1.hook_resid_post")  # noqa: E731 (names either way)
    with torch.no_grad():
        _, full = model.run_with_cache_with_saes(tokens, saes={name: sae}, names_filter=selected)
        _, last = model.run_with_cache_with_saes(tokens, saes={name: sae}, pos_slice=-1, names_filter=selected)
    assert set(last.cache_dict) == {name} | {f"{name}.{h}" for h in ("hook_sae_input", "hook_sae_acts_post",
                                                                      "hook_sae_recons", "hook_sae_output")}
    for key, value in last.cache_dict.items():
        torch.testing.assert_close(value, full.cache_dict[key][:, -1:], rtol=0, atol=0)


def test_bad_splices_are_clear_errors_that_change_nothing(tl_model, tokens):
    model = tl_model
    hooks = list(model.hook_dict)
    d = width(model, "layers.0.layer_output")
    with pytest.raises(ValueError, match=r"width 7 cannot read 'layers\.0\.layer_output'.* it is \d+ wide"):
        model.add_sae(PlainSAE(7, 4), "blocks.0.hook_resid_post")
    with pytest.raises(ValueError, match="names no hook"):
        model.add_sae(PlainSAE(d, 4))
    with pytest.raises(ValueError, match="no encode/decode"):
        model.add_sae(nn.Linear(d, d), "layers.0.layer_output")
    with pytest.raises(ValueError, match="cannot replace 'next_token_probs'.*read-only"):
        model.add_sae(PlainSAE(model.cfg.d_vocab, 4), "next_token_probs")
    with pytest.raises(ValueError, match=r"cannot replace 'layers\.0\.self_attn\.attention_probabilities'"):
        model.add_sae(PlainSAE(d, 4), "blocks.0.attn.hook_pattern")
    with pytest.raises(KeyError, match="did you mean 'layers.0.layer_output'"):
        model.add_sae(PlainSAE(d, 4), "layers.0.layer_outptu")
    with pytest.raises(ValueError, match="no SAE is spliced on 'layers.0.layer_output'"):
        model.reset_saes("blocks.0.hook_resid_post")
    # A width the SAE does not declare is checked when it runs, and the context cleans up.
    with pytest.raises(ValueError, match=r"returned shape .* the value it replaces"):
        model.run_with_saes(tokens, saes={"layers.0.layer_output": Truncating()})
    assert list(model.hook_dict) == hooks and model.acts_to_saes == {}


def test_a_module_set_at_a_transformer_lens_hook_name_is_refused(tl_model):
    """HookedSAETransformer.add_sae sets its wrapper at the hook's path (set_deep_attr): at a
    TransformerLens name that module would never be called, so the assignment is an error."""
    model = tl_model
    with pytest.raises(AttributeError, match="'hook_resid_post' is a TransformerLens name.*model.add_sae"):
        model.blocks[0].hook_resid_post = nn.Identity()
    with pytest.raises(AttributeError, match="'hook_z' is a TransformerLens name"):
        setattr(model.blocks[0].attn, "hook_z", nn.Identity())
