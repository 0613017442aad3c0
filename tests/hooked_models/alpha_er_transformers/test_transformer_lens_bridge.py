"""TransformerLens's TransformerBridge (4.3 here, 3.9 in the SAE environment) on AlphaErForCausalLM through the
package's small adapter: it boots, and its values equal HookedAlphaEr's within float32 rounding (its LayerNorm is
recomputed in separate operations, the model's is F.layer_norm: measured 4e-7 of the largest logit on the embedded
alpha-er, up to 3e-6 on this test's random one; bounded at 1e-5)."""

import pytest
import torch

pytest.importorskip("transformer_lens.model_bridge", reason="no TransformerBridge in this TransformerLens")

from transformer_lens.model_bridge import TransformerBridge  # noqa: E402

from hooked_models import HookedAlphaEr  # noqa: E402
from hooked_models.alpha_er_transformers.transformer_lens_bridge import register  # noqa: E402

NAMES = [("blocks.{i}.hook_resid_pre", "layers.{i}.layer_input"),
         ("blocks.{i}.hook_resid_post", "layers.{i}.layer_output"),
         ("blocks.{i}.hook_attn_out", "layers.{i}.self_attn.attention_output"),
         ("blocks.{i}.hook_mlp_out", "layers.{i}.mlp.mlp_output"),
         ("blocks.{i}.attn.hook_pattern", "layers.{i}.self_attn.attention_probabilities"),
         ("blocks.{i}.ln1.hook_out", "layers.{i}.attention_norm_output"),
         ("blocks.{i}.ln2.hook_out", "layers.{i}.mlp_norm_output")]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def bridge_and_ours(tmp_path_factory, tiny_factories):
    _, make_reference_alpha_er = tiny_factories
    ours = HookedAlphaEr.from_reference(make_reference_alpha_er(31, vocab_size=127, attn_soft_cap=2.0))
    ours.tokenizer = HookedAlphaEr.from_pretrained("embedded").tokenizer
    path = tmp_path_factory.mktemp("bridge") / "alpha-er"
    ours.save_pretrained(path, format="transformers")
    register()
    return TransformerBridge.boot_transformers(str(path), device="cpu"), ours


def test_the_bridge_boots_and_agrees_within_float32_rounding(bridge_and_ours):
    bridge, ours = bridge_and_ours
    tokens = torch.randint(0, 127, (2, ours.cfg.block_size), generator=torch.Generator().manual_seed(32))
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens)
        expected, our_cache = ours.run_with_cache(tokens)
    assert relative_error(logits, expected) < 1e-5
    for i in range(ours.cfg.n_layer):
        for theirs, name in NAMES:
            assert relative_error(cache[theirs.format(i=i)], our_cache[name.format(i=i)]) < 1e-5, (theirs, i)
    assert torch.equal(cache["hook_pos_embed"].expand_as(our_cache["position_embeddings"]),
                       our_cache["position_embeddings"])


def test_what_the_bridge_cannot_give_is_absent_not_wrong(bridge_and_ours):
    bridge, _ = bridge_and_ours
    with pytest.raises(AttributeError, match="no attribute 'W_U'"):
        bridge.unembed.W_U


def test_boot_does_not_warn_of_hooks_alpha_er_never_had(tmp_path, bridge_and_ours):
    # The fused, factored attention and the experts are wrapped whole: hook_q/k/v/z and the MLP's hook_pre/post
    # are not declared, so booting says nothing of them (TransformerLens's stock bridges warned seven times,
    # one calling such a hook "the wrong tensor for this layer") and reading one is a KeyError.
    import warnings

    _, ours = bridge_and_ours
    ours.save_pretrained(tmp_path / "alpha-er", format="transformers")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        bridge = TransformerBridge.boot_transformers(str(tmp_path / "alpha-er"), device="cpu")
        tokens = torch.zeros(1, ours.cfg.block_size, dtype=torch.long)
        with torch.no_grad():
            _, cache = bridge.run_with_cache(tokens)
    from_lens = [str(w.message) for w in seen if "transformer_lens" in w.filename]
    assert from_lens == []
    for name in ("blocks.0.attn.hook_q", "blocks.0.attn.hook_z", "blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post"):
        assert name not in bridge.hook_dict
        with pytest.raises(KeyError):
            cache[name]
    assert "blocks.0.attn.hook_pattern" in bridge.hook_dict and "blocks.0.mlp.hook_out" in bridge.hook_dict
