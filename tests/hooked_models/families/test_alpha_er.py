"""HookedAlphaEr against the transcribed alpha-er reference (tests/conftest.py), on random weights."""

import pytest
import torch
import torch.nn as nn

from hooked_models import AlphaErConfig, HookedAlphaEr
from hooked_models.components import FactoredProjection

# Configs beside conftest's TINY_ALPHA_ER: the cap off, one expert, ranks wider than the stream,
# as many experts as positions, many heads of width 2.
CONFIGS = [
    {},
    dict(attn_soft_cap=0.0, mlp_experts=8, n_head=2, block_size=16, attn_rank=40, lm_head_rank=3),
    dict(mlp_experts=1, n_layer=3, attn_soft_cap=4.0, ffn_dim=20),
    dict(mlp_experts=16, block_size=16, ffn_dim=32, n_head=12, n_embd=24, layer_norm_eps=1e-3),
]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected|: the 'relative' of 'within 1e-5 relative'."""
    return float((actual - expected).abs().max() / expected.abs().max())


def tokens_for(cfg, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def pair(reference_alpha_er_factory):
    """(reference, hooked) on conftest's tiny config, or on overrides."""
    def make(seed: int = 0, **overrides):
        reference = reference_alpha_er_factory(seed, **overrides)
        return reference, HookedAlphaEr.from_reference(reference)
    return make


@pytest.mark.parametrize("overrides", CONFIGS)
def test_logits_and_layers_match_reference(pair, overrides):
    reference, model = pair(seed=len(overrides), **overrides)
    cfg = model.cfg
    for seq in sorted({cfg.mlp_experts, cfg.block_size}):
        tokens = tokens_for(cfg, 3, seq)
        block_inputs = []
        handles = [block.register_forward_pre_hook(lambda m, args: block_inputs.append(args[0]))
                   for block in reference.blocks]
        with torch.no_grad():
            expected = reference(tokens)
            logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("layer_input"))
        for handle in handles:
            handle.remove()
        # Unhooked norms run the reference's own kernel, so every step is the reference's
        # arithmetic in its order: equal bit for bit, layer by layer (to localise a divergence).
        for i, block_input in enumerate(block_inputs):
            assert torch.equal(cache[f"layers.{i}.layer_input"], block_input), f"layer {i}"
        assert torch.equal(logits, expected)


def test_full_default_size_matches_reference(full_size_alpha_er):
    reference, model = full_size_alpha_er
    cfg = model.cfg
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.ffn_dim, cfg.mlp_experts,
            cfg.lm_head_rank, cfg.attn_rank, cfg.attn_soft_cap, cfg.layer_norm_eps) == (
        12288, 512, 2, 1024, 8, 20480, 64, 128, 128, 30.0, 1e-5)
    tokens = tokens_for(cfg, 1, cfg.block_size)
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))


def _sizes(model: HookedAlphaEr, hook_name: str, batch: int, seq: int) -> dict[str, int]:
    """The size of every layout dimension for one hook; `rank` is its factored projection's."""
    cfg = model.cfg
    sizes = dict(batch=batch, seq=seq, query=seq, key=seq, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, qk_head_dim=cfg.qk_head_dim,
                 vocab_size=cfg.vocab_size, intermediate_size=cfg.intermediate_size)
    path = hook_name
    while path:
        path = path.rpartition(".")[0]
        module = model.get_submodule(path)
        if isinstance(module, FactoredProjection):
            sizes["rank"] = module.rank
            break
    return sizes


def test_every_value_has_its_layout_shape(pair):
    _, model = pair(**CONFIGS[1])
    batch, seq = 2, 8
    tokens = tokens_for(model.cfg, batch, seq)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, attention_mask=torch.ones_like(tokens), names_filter=lambda n: True)
    assert set(cache.cache_dict) == set(model.standard_hook_dict)  # every value fired, the lazy ones included
    for name, tensor in cache.cache_dict.items():
        value = model.hook_dict[name].value
        assert tuple(tensor.shape) == value.shape(_sizes(model, name, batch, seq)), name
    assert cache["layers.0.self_attn.qkv_proj.bottleneck"].shape[-1] == 40
    assert cache["lm_head.bottleneck"].shape[-1] == 3


def test_residual_contributions_add_up(pair):
    _, model = pair()
    tokens = tokens_for(model.cfg, 2, 16)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for i in range(model.cfg.n_layer):
        total = cache[f"layers.{i}.layer_input"] + cache[f"layers.{i}.self_attn.attention_output"] \
            + cache[f"layers.{i}.mlp.mlp_output"]
        torch.testing.assert_close(total, cache[f"layers.{i}.layer_output"], rtol=0, atol=1e-6)
    torch.testing.assert_close(cache["layers.0.layer_input"],
                               cache["token_embeddings"] + cache["position_embeddings"], rtol=0, atol=0)
    torch.testing.assert_close(cache["pos_embed"], cache["position_embeddings"])  # TL's name, same tensor


def test_head_results_sum_to_attention_output(pair):
    _, model = pair()
    tokens = tokens_for(model.cfg, 2, 16)
    with torch.no_grad():
        plain = model(tokens)
        # Per-head results are cached on request (names_filter), as TransformerLens's hook_result.
        logits, cache = model.run_with_cache(tokens, names_filter=lambda n: True)
    attn = model.layers[0].self_attn
    results = cache["layers.0.self_attn.attention_head_results"]
    torch.testing.assert_close(results.sum(-2) + attn.out_bias(), cache["layers.0.self_attn.attention_output"],
                               rtol=1e-5, atol=1e-5)
    assert relative_error(logits, plain) < 1e-5
    assert results.abs().amax(dim=(0, 1, 3)).min() > 0  # every head contributes


def test_same_sequence_same_logits_at_any_batch_width(pair):
    _, model = pair()
    tokens = tokens_for(model.cfg, 5, 32)
    with torch.no_grad():
        batched = model(tokens)
        for row in range(tokens.shape[0]):
            assert relative_error(model(tokens[row:row + 1])[0], batched[row]) < 1e-6


# --------------------------------------------------------------------- the comparison can tell
class FlatBatchRouting(nn.Module):
    """The reference's earlier bug: experts routed on the index in the flattened batch."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.inner = mlp

    def forward(self, x, inputs=None):  # the block passes every MLP its AttentionInputs
        batch, seq, hidden = x.shape
        return self.inner(x.reshape(1, batch * seq, hidden)).reshape(batch, seq, hidden)


def _drop_soft_cap(model):
    for layer in model.layers:
        layer.self_attn.score_mod.cap = 0.0


def _exact_gelu(model):
    for layer in model.layers:
        layer.mlp.act_fn = nn.GELU()


def _flat_batch_routing(model):
    for layer in model.layers:
        layer.mlp = FlatBatchRouting(layer.mlp)


@pytest.mark.parametrize("break_", [_drop_soft_cap, _exact_gelu, _flat_batch_routing])
def test_comparison_catches_a_broken_port(pair, break_):
    reference, model = pair()
    tokens = tokens_for(model.cfg, 2, 32)
    with torch.no_grad():
        expected = reference(tokens)
        assert relative_error(model(tokens), expected) < 1e-5
        break_(model)
        model.setup()
        # Fails the same comparison (measured: cap 7e-3, exact GELU 2e-4, flat routing 1.3).
        assert relative_error(model(tokens), expected) > 1e-5


# ------------------------------------------------------------------------------- sequence length
def test_length_not_a_multiple_of_experts_is_refused(pair):
    reference, model = pair()
    tokens = tokens_for(model.cfg, 1, 6)  # 4 experts
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of mlp_experts=4") as error:
        model(tokens)
    assert "pad the input to block_size (32)" in str(error.value)
    assert "last real position" in str(error.value)
    with pytest.raises(ValueError):
        reference(tokens)  # the reference refuses it too


def test_length_past_block_size_is_refused(pair):
    _, model = pair()
    with pytest.raises(ValueError, match="sequence length 36 is longer than block_size=32") as error:
        model(tokens_for(model.cfg, 1, 36))
    assert "keep the last 32 tokens" in str(error.value)


def test_right_padding_is_exact_and_left_padding_refused(pair):
    _, model = pair()
    tokens = tokens_for(model.cfg, 2, 16)
    mask = torch.ones_like(tokens)
    mask[1, 10:] = 0
    with torch.no_grad():
        padded = model(tokens, attention_mask=mask)
        assert relative_error(padded[1, :10], model(tokens[1:])[0, :10]) < 1e-6
    with pytest.raises(ValueError, match="padding must be on the right"):
        model(tokens, attention_mask=mask.flip(-1))


# ----------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("prompt_length, settings", [
    (5, dict(temperature=0.0)),                   # greedy, the window slides past block_size
    (3, dict(temperature=0.8, top_k=5)),          # sampled from the top 5
    (30, dict(temperature=1.3, top_k=1000)),      # top_k past the vocabulary: every token
])
def test_generate_follows_the_reference_rule(pair, prompt_length, settings):
    reference, model = pair()
    prompt = tokens_for(model.cfg, 1, prompt_length, seed=prompt_length)
    torch.manual_seed(7)
    expected = reference.generate(prompt, max_new_tokens=36, **settings)
    torch.manual_seed(7)
    generated = model.generate(prompt, max_new_tokens=36, **settings)
    assert generated.tolist() == expected.tolist()
    assert generated.shape == (1, prompt_length + 36)


def test_generate_takes_a_batch_or_one_prompt(pair):
    _, model = pair()
    with pytest.raises(ValueError, match="at least one token"):
        model.generate(tokens_for(model.cfg, 1, 4)[:, :0], max_new_tokens=1)
    batch = tokens_for(model.cfg, 2, 4)
    together = model.generate(batch, max_new_tokens=3, temperature=0)  # each row its own padded window
    for row in range(2):
        assert torch.equal(together[row], model.generate(batch[row], max_new_tokens=3, temperature=0)[0])
    assert model.generate(tokens_for(model.cfg, 1, 4)[0], max_new_tokens=2, temperature=0).shape == (1, 6)


# -------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("fields, message", [
    (dict(ffn_dim=100, mlp_experts=64), "ffn_dim=100 is not divisible by mlp_experts=64"),
    (dict(n_embd=1000, n_head=16), "n_embd=1000 is not divisible by n_head=16"),
    (dict(block_size=500, mlp_experts=64), "block_size=500 is not divisible by mlp_experts=64"),
    (dict(attn_soft_cap=-1.0), "attn_soft_cap=-1.0 must be >= 0"),
    (dict(n_layer=0), "n_layer=0 must be a positive integer"),
])
def test_contradictory_config_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        AlphaErConfig(**fields)


def test_config_names():
    cfg = AlphaErConfig()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qk_head_dim,
            cfg.vocab_size, cfg.intermediate_size) == (2, 1024, 8, 8, 128, 128, 12288, 20480)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab, cfg.n_ctx) == (
        2, 1024, 8, 128, 20480, 12288, 512)
    assert cfg.expert_width == 320


def test_family_values_are_printed_and_supported(pair):
    _, model = pair()
    names = model.support().names()
    for name in ("position_embeddings", "layers.1.self_attn.score_mod.attention_raw_scores",
                 "layers.0.self_attn.qkv_proj.bottleneck", "layers.0.self_attn.o_proj.bottleneck_normed",
                 "lm_head.norm.norm_normalized", "layers.1.mlp.mlp_expert_index"):
        assert name in names
    text = repr(model)
    assert "(position_embeddings) -> Residual [batch seq hidden_size]" in text
    assert "(bottleneck) -> Bottleneck [batch seq rank]" in text
    assert "(mlp_expert_index) -> ExpertIndex [batch seq]" in text
    assert model.resolve_hook_name("hook_pos_embed")[0] == "position_embeddings"


def test_zeroing_one_experts_neuron_is_zeroing_its_weights(pair):
    reference, model = pair()
    g, n = 2, 5
    width = model.cfg.expert_width

    def zero(neurons, hook):
        neurons = neurons.clone()
        neurons[..., g * width + n] = 0.0
        return neurons

    tokens = tokens_for(model.cfg, 2, 32)
    with torch.no_grad():
        clean = reference(tokens)
        reference.blocks[1].fc2s[g, :, n] = 0.0
        expected = reference(tokens)
        edited = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mlp.hook_post", zero)])
    assert relative_error(edited, expected) < 1e-5
    assert relative_error(clean, expected) > 1e-4  # the edit matters


def test_the_patching_script_runs_unchanged(pair):
    """hooked_models.patching batches patched copies along the batch: right only because routing is
    positional. Its sweep equals one hooked forward per patch."""
    from hooked_models import patching

    _, model = pair()
    clean = tokens_for(model.cfg, 2, 8, seed=1)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 11) % model.cfg.vocab_size
    metric = patching.logit_diff_metric([5, 6], [7, 8])
    result = patching.activation_patch(model, clean, corrupted, metric, "layer_input", ("layer", "pos"))
    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        for layer in range(model.cfg.n_layer):
            for pos in range(8):
                def patch(activation, hook, layer=layer, pos=pos):
                    activation = activation.clone()
                    activation[:, pos] = cache[f"layers.{layer}.layer_input"][:, pos]
                    return activation
                logits = model.run_with_hooks(corrupted, fwd_hooks=[(f"layers.{layer}.layer_input", patch)])
                assert abs(float(metric(logits)) - float(result.values[layer, pos])) < 1e-5
    assert result.values[1, 2] != result.corrupted_metric
