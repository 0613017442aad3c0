"""HookedArcee against transformers' ArceeForCausalLM, the oracle, on tiny random configs."""

import pytest
import torch

from hooked_models import STANDARD_VALUES, VALUES, HookedArcee
from hooked_models.hooks import HookWriteError

# GQA groups of 1 and 5, head_dim != hidden/heads, YaRN and the default rotary, sequences past
# original_max_position_embeddings (16) and norm weights away from 1 (conftest's randomize_).
CONFIGS = {
    "gqa5-yarn": dict(),
    "mha-default": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=10,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "gqa2-yarn-attention-factor": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=4,
                                       rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 8,
                                                        "attention_factor": 1.5, "beta_fast": 16.0}),
    "three-layers-tied": dict(num_hidden_layers=3, tie_word_embeddings=True),
}


def rel_close(actual, expected, rtol):
    """|actual - expected| <= rtol · max|expected|, elementwise: relative to the logits' scale."""
    scale = expected.abs().max()
    torch.testing.assert_close(actual, expected, rtol=0, atol=rtol * float(scale))


def tokens(batch, seq, vocab=97, seed=0):
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(CONFIGS))
def oracle_and_model(request, hf_arcee_factory):
    hf = hf_arcee_factory(seed=1, **CONFIGS[request.param])
    return hf, HookedArcee.from_hf(hf)


def test_float32_logits_match(oracle_and_model):
    hf, model = oracle_and_model
    ids = tokens(3, 40)
    with torch.no_grad():
        rel_close(model(ids), hf(ids).logits, 1e-5)


def test_float32_logits_are_transformers_bit_for_bit(oracle_and_model, explicit_attention):
    """The same operations in the same order: the fused path is transformers' "sdpa" model and the
    explicit path (taken when a hook reads the scores) its "eager" one, bit for bit, padded or not."""
    hf, model = oracle_and_model
    ids = tokens(3, 40)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding on one row: positions are the same on both sides
    real = mask.bool()
    with torch.no_grad():
        assert torch.equal(model.run_with_hooks(ids, fwd_hooks=explicit_attention), hf(ids).logits)
        explicit = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=explicit_attention)
        assert torch.equal(explicit[real], hf(ids, attention_mask=mask).logits[real])
        hf.set_attn_implementation("sdpa")
        assert torch.equal(model(ids), hf(ids).logits)
        assert torch.equal(model(ids, attention_mask=mask)[real], hf(ids, attention_mask=mask).logits[real])


def test_layer_by_layer(oracle_and_model):
    hf, model = oracle_and_model
    ids = tokens(2, 24)
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states
        _, cache = model.run_with_cache(ids)
    for i in range(model.cfg.num_layers):
        rel_close(cache[f"layers.{i}.layer_input"], hidden[i], 1e-5)
    # transformers' last hidden state is after the final norm.
    rel_close(cache["final_norm_output"], hidden[-1], 1e-5)


def test_bfloat16_within_bfloat16_tolerance(hf_arcee_factory):
    hf = hf_arcee_factory(seed=2).to(torch.bfloat16)
    model = HookedArcee.from_hf(hf)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.cfg.dtype == torch.bfloat16
    ids = tokens(2, 32)
    with torch.no_grad():
        expected, actual = hf(ids).logits.float(), model(ids).float()
    # bf16 has 8 bits of mantissa: a few units in the last place of the logits' scale.
    rel_close(actual, expected, 2e-2)
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_sharded_checkpoint_round_trip(tmp_path, hf_arcee_factory):
    hf = hf_arcee_factory(seed=3, num_hidden_layers=3)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    model = HookedArcee.from_pretrained(tmp_path)
    assert not model.training
    ids = tokens(2, 20)
    with torch.no_grad():
        rel_close(model(ids), hf(ids).logits, 1e-5)


def test_from_pretrained_dtype_and_device(tmp_path, tiny_hf_arcee):
    tiny_hf_arcee.save_pretrained(tmp_path)
    model = HookedArcee.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())


def test_identities_are_exact(tiny_arcee):
    _, cache = tiny_arcee.run_with_cache(tokens(2, 20))
    for i in range(tiny_arcee.cfg.num_layers):
        total = cache[f"layers.{i}.layer_input"] + cache[f"layers.{i}.self_attn.attention_output"] \
            + cache[f"layers.{i}.mlp.mlp_output"]
        assert torch.equal(total, cache[f"layers.{i}.layer_output"])
        pre = cache[f"layers.{i}.mlp.mlp_pre_activation"]
        assert torch.equal(cache[f"layers.{i}.mlp.mlp_neurons"], torch.relu(pre) ** 2)
        assert (cache[f"layers.{i}.mlp.mlp_neurons"][pre < 0] == 0).all()


def test_every_hook_has_its_layout(tiny_arcee):
    batch, seq = 3, 11
    sizes = {name: getattr(tiny_arcee.cfg, name) for name in
             ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "qk_head_dim", "vocab_size",
              "intermediate_size")}
    sizes.update(batch=batch, seq=seq, query=seq, key=seq)
    with tiny_arcee.hooks(fwd_hooks=[("next_token_probs", lambda t, hook: None),
                                     ("attention_mask", lambda t, hook: None)]):
        _, cache = tiny_arcee.run_with_cache(tokens(batch, seq), names_filter=lambda n: True)
    names = set(cache.keys())
    # Every standard value of the family page is hooked, on every layer.
    for value in STANDARD_VALUES.values():
        assert any(n == value.name or n.endswith("." + value.name) for n in tiny_arcee.standard_hook_dict), value.name
    for name, tensor in cache.items():
        value = tiny_arcee.hook_dict[name].value
        if value.name == "input_size":
            assert tensor.tolist() == [batch, seq]
            continue
        assert tuple(tensor.shape) == value.shape(sizes), name
    assert "layers.1.self_attn.attention_head_results" in names


def test_gqa_edit_reaches_only_its_query_heads(hf_arcee_factory):
    model = HookedArcee.from_hf(hf_arcee_factory(seed=4))  # 10 query heads over 2 kv heads: groups of 5
    groups = model.cfg.num_heads // model.cfg.num_kv_heads
    ids = tokens(1, 16)
    _, clean = model.run_with_cache(ids, names_filter=lambda n: n.endswith("attention_head_outputs"))
    for j in range(model.cfg.num_kv_heads):
        def edit(keys, hook, j=j):
            keys = keys.clone()
            # Random per key: a constant shift of every key would leave the softmax unchanged.
            keys[:, j] += torch.randn(keys[:, j].shape, generator=torch.Generator().manual_seed(j))
            return keys

        with model.hooks(fwd_hooks=[("layers.0.self_attn.attention_keys", edit)]):
            _, edited = model.run_with_cache(ids, names_filter="layers.0.self_attn.attention_head_outputs")
        diff = (edited["layers.0.self_attn.attention_head_outputs"]
                - clean["layers.0.self_attn.attention_head_outputs"]).abs().amax(dim=(0, 1, 3))
        changed = set(torch.nonzero(diff > 1e-6).flatten().tolist())
        assert changed == set(range(j * groups, j * groups + groups))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_invariance(tiny_arcee, side):
    lengths = [9, 14, 5]
    width = max(lengths)
    prompts = [tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        span = slice(0, len(p)) if side == "right" else slice(width - len(p), width)
        ids[row, span], mask[row, span] = p, 1
    with torch.no_grad():
        batched = tiny_arcee(ids, attention_mask=mask)
        for row, p in enumerate(prompts):
            alone = tiny_arcee(p[None])[0]
            span = slice(0, len(p)) if side == "right" else slice(width - len(p), width)
            rel_close(batched[row, span], alone, 1e-5)


def test_writes_flow_on_and_read_only_values_refuse(tiny_arcee):
    ids = tokens(1, 12)
    with torch.no_grad():
        clean = tiny_arcee(ids)
        zeroed = tiny_arcee.run_with_hooks(
            ids, fwd_hooks=[("layers.1.mlp.mlp_output", lambda t, hook: torch.zeros_like(t))])
        _, cache = tiny_arcee.run_with_cache(ids)
        # Without layer 1's MLP, the logits are the final norm and head of layer_mid.
        expected = tiny_arcee.lm_head(tiny_arcee.norm(cache["layers.1.layer_mid"]))
    rel_close(zeroed, expected, 1e-6)
    assert not torch.allclose(zeroed, clean)
    with pytest.raises(HookWriteError, match="next_token_probs.*read-only"):
        tiny_arcee.run_with_hooks(ids, fwd_hooks=[("next_token_probs", lambda t, hook: t * 2)])
    assert not tiny_arcee.list_hooks()


def test_next_token_probs_reads_the_last_real_position(tiny_arcee):
    ids = tokens(2, 10)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    seen = {}
    logits = tiny_arcee.run_with_hooks(
        ids, attention_mask=mask, fwd_hooks=[("next_token_probs", lambda t, hook: seen.__setitem__("p", t))])
    torch.testing.assert_close(seen["p"][0], logits[0, -1].softmax(-1))
    torch.testing.assert_close(seen["p"][1], logits[1, 5].softmax(-1))


def test_printout_shows_every_value_with_layout_and_meaning(tiny_arcee):
    text = repr(tiny_arcee)
    for value in STANDARD_VALUES.values():
        assert f"({value.name}) -> {value.layout_text}: {value.meaning}" in text
    for module in ("(embed_tokens): Embedding(97, 40)", "(q_proj)", "(k_proj)", "(v_proj)", "(o_proj)",
                   "(up_proj)", "(down_proj)", "(input_layernorm): RMSNorm", "(post_attention_layernorm)",
                   "(norm): RMSNorm", "(lm_head): Linear", "(0-1): 2 x PreNormBlock"):
        assert module in text


def test_support_lists_values_by_host(tiny_arcee):
    support = tiny_arcee.support()
    hosts = support.by_host()
    assert [r.name.rpartition(".")[2] for r in hosts["layers.0.self_attn"]][:8] == [
        "attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_premix",
        "attention_output", "attention_probabilities", "attention_head_outputs"]
    rows = {r.name: r for r in support}
    assert rows["layers.0.layer_input"].layout == "Residual [batch seq hidden_size]"
    assert rows["layers.0.layer_input"].tl_name == "blocks.0.hook_resid_pre"
    assert rows["logits"].host == "model" and rows["layers.1.mlp.mlp_neurons"].host == "mlp"
    assert len(support) == len(tiny_arcee.standard_hook_dict)
    assert "attention_probabilities" in str(support)
    assert all(VALUES[r.name.rpartition(".")[2]].meaning == r.meaning for r in support)


def test_run_with_cache_returns_an_activation_cache(tiny_arcee):
    from transformer_lens import ActivationCache

    _, cache = tiny_arcee.run_with_cache(tokens(1, 5))
    assert isinstance(cache, ActivationCache)
    assert cache["layers.0.layer_input"] is cache["blocks.0.hook_resid_pre"]
    assert cache["resid_pre", 0] is cache["layers.0.layer_input"]


def test_config_has_the_standard_fields(tiny_arcee):
    cfg = tiny_arcee.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qk_head_dim,
            cfg.vocab_size, cfg.intermediate_size) == (2, 40, 10, 2, 6, 6, 97, 56)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_mlp,
            cfg.d_vocab) == (2, 40, 10, 2, 6, 56, 97)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 20.0
