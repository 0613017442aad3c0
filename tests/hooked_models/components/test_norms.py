import torch
from transformers.models.arcee.modeling_arcee import ArceeRMSNorm

from hooked_models.components import LayerNorm, RMSNorm


def test_rms_norm_matches_transformers():
    ours, theirs = RMSNorm(16, 1e-5), ArceeRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16))
        ours.weight.copy_(theirs.weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 5, 16) * 3).to(dtype)
        torch.testing.assert_close(ours.to(dtype)(x), theirs.to(dtype)(x))


def test_layer_norm_matches_torch():
    ours, theirs = LayerNorm(16, 1e-5), torch.nn.LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16))
        theirs.bias.copy_(torch.randn(16))
        ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 16) * 3 + 1
    torch.testing.assert_close(ours(x), theirs(x))
