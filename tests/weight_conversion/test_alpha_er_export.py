"""alpha-er's way back after TransformerLens-style weight edits and processing."""

import pytest
import torch


def test_alpha_er_export_after_an_edit_and_refused_after_folding_biases(tl_model_factory, tmp_path):
    """alpha-er's own format round-trips an edit; after fold_ln (which gives bias-free readers of its
    LayerNorms a bias) it says clearly that the format has no place for them."""
    from hooked_models import HookedAlphaEr
    from weight_conversion.checkpoint import CheckpointError

    model = tl_model_factory("alpha_er")
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.blocks[0].attn.W_O.A[1] *= -2.0
        model.save_pretrained(tmp_path / "edited")
        torch.testing.assert_close(HookedAlphaEr.from_pretrained(tmp_path / "edited")(tokens), model(tokens),
                                   rtol=0, atol=0)
        model.fold_ln()
    assert model.blocks[0].attn.qkv_proj.down_bias is not None
    with pytest.raises(CheckpointError, match="down_bias.*fold_ln"):
        model.save_pretrained(tmp_path / "folded")
