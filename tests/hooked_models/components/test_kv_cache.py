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
    alpha_er = HookedAlphaEr.from_reference(reference_alpha_er_factory())
    with pytest.raises(ValueError, match="HookedAlphaEr does not support a key/value cache"):
        alpha_er(torch.ones(1, 32, dtype=torch.long), past_kv_cache=KeyValueCache())


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
