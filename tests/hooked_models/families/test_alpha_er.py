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
        for i, block_input in enumerate(block_inputs):  # layer by layer, to localise a divergence
            assert relative_error(cache[f"layers.{i}.layer_input"], block_input) < 1e-6
        assert relative_error(logits, expected) < 1e-5


def test_full_default_size_matches_reference(full_size_alpha_er):
    reference, model = full_size_alpha_er
    cfg = model.cfg
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.ffn_dim, cfg.mlp_experts,
            cfg.lm_head_rank, cfg.attn_rank, cfg.attn_soft_cap, cfg.layer_norm_eps) == (
        12288, 512, 2, 1024, 8, 20480, 64, 128, 128, 30.0, 1e-5)
    tokens = tokens_for(cfg, 1, cfg.block_size)
    with torch.no_grad():
        assert relative_error(model(tokens), reference(tokens)) < 1e-5


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
        _, cache = model.run_with_cache(tokens, attention_mask=torch.ones_like(tokens))
    assert set(cache.cache_dict) == set(model.hook_dict)  # every value fired, the lazy ones included
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
        logits, cache = model.run_with_cache(tokens)
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

    def forward(self, x):
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
        assert relative_error(model(tokens), expected) > 1e-4
