"""TransformerLens's forward arguments on both families: stop_at_layer, start_at_layer, tokens=,
loss_per_token, return_type with them, prepend_bos and padding_side; each against the full run."""

import pytest
import torch
import torch.nn.functional as F


def _inputs(model, seed=0, padded=False):
    """A batch of 3 x 8 token ids (8 is a multiple of alpha-er's tiny 4 experts), and a padded mask
    where asked: on the right for alpha-er (its rule), on the left for Arcee."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (3, 8), generator=generator)
    if not padded:
        return tokens, None
    mask = torch.ones_like(tokens)
    if model.cfg.original_architecture == "AlphaErForCausalLM":
        mask[1, 5:] = 0
    else:
        mask[1, :3] = 0
    return tokens, mask


@pytest.mark.parametrize("padded", [False, True])
def test_stop_at_layer_is_the_cached_layer_input_and_start_at_layer_resumes_exactly(tl_model, padded):
    tokens, mask = _inputs(tl_model, padded=padded)
    n = tl_model.cfg.n_layers
    # Only the residual stream is cached, so the attention takes its fused path, as a plain forward does.
    logits, cache = tl_model.run_with_cache(tokens, attention_mask=mask,
                                            names_filter=lambda name: name.endswith(("layer_input", "layer_output")))
    assert torch.equal(logits, tl_model(tokens, attention_mask=mask))
    for k in range(n + 1):
        stopped = tl_model(tokens, attention_mask=mask, stop_at_layer=k)
        expected = cache[f"layers.{k}.layer_input"] if k < n else cache[f"layers.{n - 1}.layer_output"]
        assert torch.equal(stopped, expected), k
        if k < n:  # negative counts from the end: -n is layer 0
            assert torch.equal(tl_model(tokens, attention_mask=mask, stop_at_layer=k - n), stopped), k
        resumed = tl_model(stopped, attention_mask=mask, start_at_layer=k)
        assert torch.equal(resumed, logits), k
    # Both at once: the layers in between only, the same numbers.
    middle = tl_model(cache["layers.0.layer_input"], attention_mask=mask, start_at_layer=0, stop_at_layer=1)
    assert torch.equal(middle, cache["layers.1.layer_input"])


def test_stop_at_layer_runs_nothing_above_it(tl_model):
    tokens, _ = _inputs(tl_model)
    fired = []
    hooks = [(lambda name: True, lambda x, hook: fired.append(hook.name))]
    out = tl_model.run_with_hooks(tokens, fwd_hooks=hooks, stop_at_layer=1, return_type="loss")
    assert out.shape == (3, 8, tl_model.cfg.d_model)  # the stream, whatever return_type says
    assert fired and all(not name.startswith(("layers.1.", "norm.", "lm_head")) for name in fired)
    assert "layers.0.layer_output" in fired and "logits" not in fired and "final_norm_output" not in fired


def test_sae_lens_style_cache_call(tl_model):
    """SAELens's activation store: run_with_cache(batch, names_filter=[hook], stop_at_layer=k+1, prepend_bos=False)."""
    tokens, _ = _inputs(tl_model)
    for name in ("layers.0.layer_output", "blocks.0.hook_resid_post", "blocks.0.attn.hook_z"):
        _, full = tl_model.run_with_cache(tokens, names_filter=[name])
        out, cache = tl_model.run_with_cache(tokens, names_filter=[name], stop_at_layer=1, prepend_bos=False)
        assert list(cache.keys()) == [tl_model.resolve_hook_name(name)[0]]
        assert torch.equal(cache[name], full[name])


def test_start_at_layer_gives_loss_with_tokens(tl_model):
    tokens, mask = _inputs(tl_model, padded=True)
    logits, loss = tl_model(tokens, attention_mask=mask, return_type="both")
    resid = tl_model(tokens, attention_mask=mask, stop_at_layer=1)
    resumed_logits, resumed_loss = tl_model(resid, attention_mask=mask, start_at_layer=1, tokens=tokens,
                                            return_type="both")
    assert torch.equal(resumed_logits, logits) and torch.equal(resumed_loss, loss)
    with pytest.raises(ValueError, match="tokens="):
        tl_model(resid, start_at_layer=1, return_type="loss")


def test_loss_per_token_is_transformer_lens_cross_entropy(tl_model):
    tokens, mask = _inputs(tl_model, padded=True)
    logits, per_token = tl_model(tokens, attention_mask=mask, return_type="both", loss_per_token=True)
    assert per_token.shape == (3, 7)
    # TransformerLens's per-token loss: -log p(next token), zero where this or the next token is padding.
    log_probs = logits.float().log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    keep = (mask[:, 1:] * mask[:, :-1]).float()
    torch.testing.assert_close(per_token, -log_probs * keep, rtol=1e-6, atol=1e-6)
    assert bool((per_token[keep == 0] == 0).all())
    mean = tl_model(tokens, attention_mask=mask, return_type="loss")
    torch.testing.assert_close(mean, per_token.sum() / keep.sum(), rtol=1e-6, atol=0)
    hooked = tl_model.run_with_hooks(tokens, attention_mask=mask, return_type="loss", loss_per_token=True,
                                     fwd_hooks=[])
    assert torch.equal(hooked, per_token)
    unmasked = tl_model(tokens, return_type="loss", loss_per_token=True)
    expected = F.cross_entropy(tl_model(tokens)[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                               reduction="none").view(3, 7)
    assert torch.equal(unmasked, expected)


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_prepend_bos_and_padding_side_for_text(family):
    from hooked_models import HookedAlphaEr, HookedArcee

    model = (HookedArcee if family == "arcee" else HookedAlphaEr).from_pretrained("embedded")
    bos = model.tokenizer.bos_token_id
    fired = {}
    hook = ("input_ids", lambda ids, hook: fired.__setitem__("ids", ids.clone()))
    if family == "arcee":
        texts = ["When Mary and John went to the store", " Mary"]
        model.run_with_hooks(texts, fwd_hooks=[hook], prepend_bos=False, padding_side="left")
        ids, mask = model.to_tokens(texts, prepend_bos=False, padding_side="left", return_mask=True)
        assert torch.equal(fired["ids"], ids) and ids[0, 0] != bos and mask[1, 0] == 0 and mask[1, -1] == 1
        with_bos = model(texts[0], prepend_bos=True)
        assert torch.equal(with_bos, model(model.to_tokens(texts[0], prepend_bos=True)))
        # None is the default, as TransformerLens's callers (HookedSAETransformer) pass it through.
        assert torch.equal(model.to_tokens(texts, prepend_bos=None, padding_side=None), model.to_tokens(texts))
        assert model.to_tokens(texts)[0, 0] == bos
        with pytest.raises(ValueError, match="padding_side must be 'left' or 'right', not 'middle'"):
            model(texts, padding_side="middle")
        assert not torch.equal(model(texts[0], prepend_bos=False)[:, -1], with_bos[:, -1])
    else:  # 16-token windows: text input is checked against the length rule like ids
        text = "When Mary and John went to the store together, John gave a drink to"
        ids = model.to_tokens(text, prepend_bos=True)
        model.run_with_hooks(text, fwd_hooks=[hook], prepend_bos=True)
        assert torch.equal(fired["ids"], ids) and ids[0, 0] == bos
        with pytest.raises(ValueError, match="multiple of mlp_experts"):
            model(text, prepend_bos=False)


def test_bad_partial_run_arguments_are_named(tl_model):
    tokens, _ = _inputs(tl_model)
    n = tl_model.cfg.n_layers
    resid = tl_model(tokens, stop_at_layer=1)
    cases = [
        (dict(input=tokens, stop_at_layer=n + 1), "stop_at_layer=3 must be an integer layer index in \\[-2, 2\\]"),
        (dict(input=tokens, stop_at_layer=-n - 1), "stop_at_layer=-3"),
        (dict(input=resid, start_at_layer=2, stop_at_layer=1), "stop_at_layer=1 comes before start_at_layer=2"),
        (dict(input=tokens, start_at_layer=1), "the input is the residual stream"),
        (dict(input=resid[..., :-1], start_at_layer=1), "width"),
        (dict(input=resid, start_at_layer=1, tokens=tokens[:, :4]), "tokens have shape"),
        (dict(input=resid, start_at_layer=1, attention_mask=torch.ones(3, 4)), "attention_mask has shape"),
        (dict(input=tokens, tokens=tokens), "tokens= goes with start_at_layer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            tl_model(**kwargs)
    assert not any(p.fwd_hooks for p in tl_model.hook_dict.values())
