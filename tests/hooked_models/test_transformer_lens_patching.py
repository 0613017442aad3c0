"""transformer_lens.patching, unchanged, against a plain loop over the standard hooks.

The sweeps run through TransformerLens names and layouts (`blocks.{i}.attn.hook_k` is
[batch pos kv_head d_head], swept over n_key_value_heads); the loop patches the standard values
in their own layouts. They must agree number for number, GQA key/value heads included."""

import pytest
import torch
from transformer_lens import patching

from hooked_models.transformer_lens_compat import TRANSFORMER_LENS_4

SEQ = 4


def metric(logits):
    return (logits[:, -1, 3] - logits[:, -1, 5]).mean()


@pytest.fixture
def setup(tl_model):
    generator = torch.Generator().manual_seed(3)
    clean = torch.randint(0, tl_model.cfg.d_vocab, (2, SEQ), generator=generator)
    corrupted = torch.randint(0, tl_model.cfg.d_vocab, (2, SEQ), generator=generator)
    with torch.no_grad():
        _, cache = tl_model.run_with_cache(clean)
    return tl_model, corrupted, cache


def loop(model, corrupted, cache, name, sizes, index):
    """metric after patching `name` (a standard value) at `index(indices)`, for every index."""
    out = torch.zeros(sizes)
    for indices in torch.cartesian_prod(*[torch.arange(n) for n in sizes]).tolist():
        layer, *rest = indices
        hook_name = name.format(layer=layer)
        clean = cache[hook_name]

        def patch(tensor, hook, rest=rest):
            tensor = tensor.clone()
            where = index(*rest)
            tensor[where] = clean[where]
            return tensor

        with torch.no_grad():
            out[tuple(indices)] = metric(model.run_with_hooks(corrupted, fwd_hooks=[(hook_name, patch)]))
    return out


ALL = slice(None)


def test_resid_pre_and_block_every(setup):
    model, corrupted, cache = setup
    n = model.cfg.n_layers
    by_pos = lambda pos: (ALL, pos)  # noqa: E731
    expected = torch.stack([loop(model, corrupted, cache, name, (n, SEQ), by_pos) for name in
                            ("layers.{layer}.layer_input", "layers.{layer}.self_attn.attention_output",
                             "layers.{layer}.mlp.mlp_output")])
    with torch.no_grad():
        resid = patching.get_act_patch_resid_pre(model, corrupted, cache, metric)
        every = patching.get_act_patch_block_every(model, corrupted, cache, metric)
    torch.testing.assert_close(resid, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(every, expected, rtol=1e-5, atol=1e-5)


def test_attn_head_out_all_pos(setup):
    model, corrupted, cache = setup
    expected = loop(model, corrupted, cache, "layers.{layer}.self_attn.attention_head_outputs",
                    (model.cfg.n_layers, model.cfg.n_heads), lambda head: (ALL, ALL, head))
    with torch.no_grad():
        got = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_attn_head_by_pos_every(setup):
    """out, q, k, v, pattern by position; k and v over the kv heads, zero-padded to n_heads."""
    model, corrupted, cache = setup
    n, heads, kv = model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads
    # Queries and keys before rotary where the family has rotary (Arcee), else the only ones.
    unrotated = "_unrotated" if "layers.0.self_attn.attention_queries_unrotated" in model.hook_dict else ""
    sweep = lambda name, h: loop(model, corrupted, cache, f"layers.{{layer}}.self_attn.{name}",  # noqa: E731
                                 (n, SEQ, h), lambda pos, head: (ALL, head, pos))
    out = loop(model, corrupted, cache, "layers.{layer}.self_attn.attention_head_outputs", (n, SEQ, heads),
               lambda pos, head: (ALL, pos, head))
    q = sweep("attention_queries" + unrotated, heads)
    k = sweep("attention_keys" + unrotated, kv)
    v = sweep("attention_values", kv)
    pattern = loop(model, corrupted, cache, "layers.{layer}.self_attn.attention_probabilities", (n, SEQ, heads),
                   lambda pos, head: (ALL, head, pos))
    pad = lambda t: torch.nn.functional.pad(t, (0, heads - t.shape[-1]))  # noqa: E731
    expected = torch.stack([out, q, pad(k), pad(v), pattern])
    with torch.no_grad():
        got = patching.get_act_patch_attn_head_by_pos_every(model, corrupted, cache, metric)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got[2].abs().max() > 0
    if kv < heads:  # GQA (Arcee): the kv sweeps are zero past the kv heads
        assert got[2:4, :, :, kv:].abs().max() == 0


@pytest.mark.skipif(not TRANSFORMER_LENS_4, reason="TransformerLens 4.x's patching checks the model's mode; 3.x's does not")
def test_patching_refuses_a_model_in_training_mode(setup):
    model, corrupted, cache = setup
    model.train()
    with pytest.raises(ValueError, match="evaluation mode"):
        patching.get_act_patch_resid_pre(model, corrupted, cache, metric)
    model.eval()
