import pytest
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


def _reader(seen):
    return lambda t, hook: seen.append(t.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_read_change_no_bit_and_writes_take_effect(dtype):
    """Hooks that read a norm's scale or normalized value leave its output bit for bit the
    reference's (torch's layer_norm; transformers' RMSNorm); a write, by return or in place, makes the
    output that of the written value, as TransformerLens means it; the hooks see the real values."""
    torch.manual_seed(0)
    layer_norm, rms_norm = LayerNorm(16, 1e-5), RMSNorm(16, 1e-5)
    reference_ln, reference_rms = torch.nn.LayerNorm(16, eps=1e-5), ArceeRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        for p in (*reference_ln.parameters(), reference_rms.weight):
            p.copy_(torch.randn(p.shape))
    layer_norm.load_state_dict(reference_ln.state_dict())
    rms_norm.load_state_dict(reference_rms.state_dict())
    x = (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(dtype)
    x32 = x.float()
    for ours, theirs, centred in ((layer_norm, reference_ln, x32 - x32.mean(-1, keepdim=True)), (rms_norm, reference_rms, x32)):
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        with torch.no_grad():
            expected = theirs(x)
            assert torch.equal(ours(x), expected)
            seen = []
            ours.norm_scale.add_hook(_reader(seen))
            ours.norm_normalized.add_hook(_reader(seen))
            try:
                assert torch.equal(ours(x), expected)  # reading changes no bit
            finally:
                ours.norm_scale.remove_hooks()
                ours.norm_normalized.remove_hooks()
            scale = (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
            torch.testing.assert_close(seen[0], scale)
            torch.testing.assert_close(seen[1], (centred / scale).to(dtype), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)
            bias = getattr(ours, "bias", 0.0)
            for write in (lambda t, hook: t * 2, lambda t, hook: t.mul_(2)):  # by return, in place
                ours.norm_scale.add_hook(write)
                try:
                    halved = ours(x).float()
                finally:
                    ours.norm_scale.remove_hooks()
                want = ((centred / (2 * scale)).to(dtype) * ours.weight + bias).float()
                torch.testing.assert_close(halved, want, **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))
            ours.norm_normalized.add_hook(lambda t, hook: torch.zeros_like(t))
            try:
                assert torch.equal(ours(x), torch.zeros_like(x) * ours.weight + bias)  # a replacement, exactly
            finally:
                ours.norm_normalized.remove_hooks()
