"""The way back: `HookedArcee.save_pretrained` writes a checkpoint transformers loads with the
hooked model's logits, including after an edit in hooked form and after weight processing."""

import pytest
import torch
from transformers import ArceeForCausalLM

from hooked_models import HookedArcee


def logits_of_export(model, path):
    model.save_pretrained(str(path))
    hf = ArceeForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens), hf(tokens).logits


def test_export_round_trip_after_an_edit_and_after_fold_ln(tl_model_factory, tmp_path):
    model = tl_model_factory("arcee")
    ours, theirs = logits_of_export(model, tmp_path / "plain")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    original = ours
    with torch.no_grad():
        model.blocks[1].attn.W_O[2] *= -3.0  # an edit made through a TransformerLens view
        model.blocks[0].mlp.W_out[:5] = 0.0
    ours, theirs = logits_of_export(model, tmp_path / "edited")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, original, atol=1e-3)
    model.fold_ln()
    model.center_unembed()
    folded, theirs = logits_of_export(model, tmp_path / "folded")
    torch.testing.assert_close(theirs, folded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(folded.log_softmax(-1), ours.log_softmax(-1), rtol=1e-5, atol=1e-5)
    # The export loads back into a HookedArcee with every folded weight as it was, so the same logits.
    reloaded = HookedArcee.from_pretrained(str(tmp_path / "folded"))
    expected = model.state_dict()
    assert set(reloaded.state_dict()) == set(expected)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens), folded)


@pytest.mark.parametrize("tie", [True])
def test_fold_ln_unties_a_tied_head_and_exports_it(hf_arcee_factory, tmp_path, tie):
    hf = hf_arcee_factory(tie_word_embeddings=tie, vocab_size=31, hidden_size=16, intermediate_size=24,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    model = HookedArcee.from_hf(hf)
    assert model.lm_head.weight is model.embed_tokens.weight
    embedding = model.W_E.detach().clone()
    model.fold_ln()
    assert model.lm_head.weight is not model.embed_tokens.weight and not model.cfg.tie_word_embeddings
    torch.testing.assert_close(model.W_E, embedding, rtol=0, atol=0)
    ours, theirs = logits_of_export(model, tmp_path)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

