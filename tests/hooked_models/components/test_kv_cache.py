"""The key/value cache: a forward in pieces equals one forward over the whole sequence."""

import pytest
import torch

from hooked_models.components.kv_cache import KeyValueCache


@pytest.mark.parametrize("padded", [False, True])
def test_pieces_equal_the_whole(tiny_arcee, tiny_hf_arcee, padded):
    tokens = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    if padded:
        mask[0, :7] = 0  # left padding: row 0's positions start at its first real token
    cache = KeyValueCache()
    pieces = []
    with torch.no_grad():
        expected = tiny_hf_arcee(tokens, attention_mask=mask).logits
        # A prompt, single positions, then a chunk that outgrows the first buffer (16 positions).
        for start, stop in [(0, 9), (9, 10), (10, 11), (11, 40)]:
            piece_mask = mask[:, start:stop] if padded and start == 0 else None
            pieces.append(tiny_arcee(tokens[:, start:stop], attention_mask=piece_mask, past_kv_cache=cache))
    assert cache.length == 40
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], expected[real], rtol=1e-5, atol=1e-5)


def test_cache_errors(tiny_arcee, reference_alpha_er_factory):
    from hooked_models import HookedAlphaEr

    cache = KeyValueCache()
    limit = tiny_arcee.cfg.max_position_embeddings
    with torch.no_grad():
        tiny_arcee(torch.ones(1, limit - 2, dtype=torch.long), past_kv_cache=cache)
        with pytest.raises(ValueError, match=f"{limit - 2} cached \\+ 3 new positions exceed the model's {limit}"):
            tiny_arcee(torch.ones(1, 3, dtype=torch.long), past_kv_cache=cache)
        with pytest.raises(ValueError, match="holds a batch of 1 rows, but the call has 2"):
            tiny_arcee(torch.ones(2, 1, dtype=torch.long), past_kv_cache=cache)
    # alpha-er's length rule counts the cached positions: 5 cached + 2 new is not a multiple of 4 experts.
    alpha_er = HookedAlphaEr.from_reference(reference_alpha_er_factory())
    cache = KeyValueCache.prefilled(torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length 7 is not a multiple of mlp_experts=4"):
        alpha_er(torch.ones(1, 2, dtype=torch.long), past_kv_cache=cache)
    with pytest.raises(ValueError, match=r"keys \(1, 4, 3, 6\) and values \(1, 4, 3, 6\) do not cover "
                                         r"the mask's 1 rows × 5 positions"):
        KeyValueCache.prefilled(torch.ones(1, 5, dtype=torch.long),
                                {alpha_er.layers[0].self_attn: (torch.ones(1, 4, 3, 6), torch.ones(1, 4, 3, 6))})


@pytest.mark.parametrize("padded", [False, True])
def test_a_window_after_a_prefilled_cache_is_the_full_run(tl_model, padded):
    """`start_at_layer=k` on positions p ... with the full run's keys and values of the positions
    before p in a cache (`KeyValueCache.prefilled`) gives the full run's logits there, for every
    layer and position, both families (alpha-er's experts routing by absolute position).

    To float32 rounding, not bit for bit: a matmul's rounding depends on how many rows it is given
    (with this torch's CPU BLAS, `F.linear(x[s:], w)` and `F.linear(x, w)[s:]` differ in the last bits
    for most row counts), and the window has fewer rows than the full run; its attention reads the
    cached keys under an explicit mask rather than the causal flag. Measured: at most 2.6 float32
    epsilons of the largest logit; the bound is 8.
    """
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tl_model.cfg.vocab_size, (3, 8), generator=generator)
    mask = torch.ones_like(tokens)
    if padded and tl_model.cfg.original_architecture == "AlphaErForCausalLM":
        mask[1, 5:] = 0  # alpha-er pads on the right (its rule)
    elif padded:
        mask[1, :3] = 0  # Arcee here on the left
    layers = tl_model.cfg.num_layers
    with torch.no_grad():
        logits, cache = tl_model.run_with_cache(tokens, attention_mask=mask, names_filter=lambda name: name.endswith(
            ("layer_input", "attention_keys", "attention_values")))
        bound = 8 * torch.finfo(torch.float32).eps * logits.abs().max()
        for layer in range(layers):
            for start in range(1, 8):
                kv = KeyValueCache.prefilled(mask[:, :start], {
                    tl_model.layers[j].self_attn: (cache[f"layers.{j}.self_attn.attention_keys"][:, :, :start],
                                                   cache[f"layers.{j}.self_attn.attention_values"][:, :, :start])
                    for j in range(layer, layers)}, room=8 - start)
                window = tl_model(cache[f"layers.{layer}.layer_input"][:, start:], start_at_layer=layer,
                                  attention_mask=mask[:, start:], past_kv_cache=kv)
                assert kv.length == 8
                real = mask[:, start:].bool()  # padding positions' logits are never read
                assert (window - logits[:, start:])[real].abs().max() <= bound, (layer, start)


def test_logits_to_keep(tiny_arcee):
    tokens = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0
    seen = []
    hooks = [("next_token_probs", lambda p, hook: seen.append(p))]
    with torch.no_grad():
        full, expected = tiny_arcee.run_with_cache(tokens, attention_mask=mask, names_filter="next_token_probs")
        with tiny_arcee.hooks(fwd_hooks=hooks):
            kept = tiny_arcee(tokens, attention_mask=mask, logits_to_keep=3)
    torch.testing.assert_close(kept, full[:, -3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen[0], expected["next_token_probs"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs every position's logits"):
        tiny_arcee(tokens, return_type="loss", logits_to_keep=1)
