"""The one table: consistent with itself, with the family page, and with the models built from it."""

import torch

from hooked_models.vocabulary import LAYOUTS, STANDARD_VALUES, VALUES, tl_module_path

# The family page's values, by host (shared/seeds/000_*.txt).
FAMILY_PAGE = {
    "model": {"logits", "token_embeddings", "final_norm_output", "lm_head_output", "next_token_probs", "input_ids",
              "attention_mask", "input_size"},
    "layer": {"layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input", "layer_output"},
    "attention": {"attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_premix",
                  "attention_output", "attention_probabilities", "attention_head_outputs"},
    "mlp": {"mlp_activation", "mlp_neurons", "mlp_output"},
}


def test_the_family_page_values_are_the_standard_ones():
    by_host = {}
    for value in STANDARD_VALUES.values():
        by_host.setdefault(value.host, set()).add(value.name)
    assert by_host == FAMILY_PAGE


def test_layouts_as_the_family_page_prints_them():
    assert VALUES["attention_queries"].layout_text == "Queries [batch num_heads seq qk_head_dim]"
    assert VALUES["attention_keys"].layout_text == "Keys [batch num_kv_heads seq qk_head_dim]"
    assert VALUES["attention_values"].layout_text == "Values [batch num_kv_heads seq head_dim]"
    assert VALUES["attention_scores"].layout_text == "Pattern [batch num_heads query key]"
    assert VALUES["attention_premix"].layout_text == "HeadOutputs [batch seq num_heads head_dim]"
    assert VALUES["next_token_probs"].layout_text == "NextTokenProbs [batch vocab_size]"
    assert VALUES["input_size"].layout_text == "scalar"
    assert all(v.layout in LAYOUTS for v in VALUES.values())


def test_position_axes_come_from_layouts():
    assert VALUES["layer_input"].seq_axis == -2
    assert VALUES["attention_queries"].seq_axis == -2
    assert VALUES["attention_head_outputs"].seq_axis == -3
    assert VALUES["attention_scores"].seq_axis == -2  # the query axis
    assert VALUES["input_ids"].seq_axis == -1
    assert VALUES["next_token_probs"].seq_axis is None


def test_tl_layout_round_trips_without_copies():
    value = VALUES["attention_queries"]
    x = torch.randn(2, 3, 5, 4)
    tl = value.to_tl(x)
    assert tl.shape == (2, 5, 3, 4) and tl.data_ptr() == x.data_ptr()
    assert torch.equal(value.from_tl(tl), x)


def test_tl_module_paths():
    assert tl_module_path("layers.3.self_attn") == "blocks.3.attn"
    assert tl_module_path("layers.3.post_attention_layernorm") == "blocks.3.ln2"
    assert tl_module_path("norm") == "ln_final"
    assert tl_module_path("layers.3.mlp.up_proj") is None


def test_aliases_are_unique_and_resolve(tiny_arcee):
    assert len(set(tiny_arcee.aliases)) == len(tiny_arcee.aliases)
    expected = {
        "hook_embed": "token_embeddings",
        "blocks.1.hook_resid_pre": "layers.1.layer_input",
        "blocks.1.hook_resid_mid": "layers.1.layer_mid",
        "blocks.1.hook_resid_post": "layers.1.layer_output",
        "blocks.1.hook_attn_out": "layers.1.self_attn.attention_output",
        "blocks.1.hook_mlp_out": "layers.1.mlp.mlp_output",
        "blocks.1.attn.hook_q": "layers.1.self_attn.attention_queries_unrotated",
        "blocks.1.attn.hook_rot_k": "layers.1.self_attn.attention_keys",
        "blocks.1.attn.hook_pattern": "layers.1.self_attn.attention_probabilities",
        "blocks.1.attn.hook_z": "layers.1.self_attn.attention_head_outputs",
        "blocks.1.mlp.hook_pre": "layers.1.mlp.mlp_pre_activation",
        "blocks.1.mlp.hook_post": "layers.1.mlp.mlp_neurons",
        "blocks.1.ln2.hook_scale": "layers.1.post_attention_layernorm.norm_scale",
        "ln_final.hook_normalized": "norm.norm_normalized",
    }
    for alias, canonical in expected.items():
        assert tiny_arcee.resolve_hook_name(alias)[0] == canonical
