"""The factored projection and the soft cap, against their formulas written out."""

import pytest
import torch
import torch.nn.functional as F

from hooked_models.components import FactoredProjection, SoftCap


@pytest.fixture
def projection():
    torch.manual_seed(0)
    module = FactoredProjection(12, 5, 9, eps=1e-5)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape))
    return module


def formula(p: FactoredProjection, x: torch.Tensor) -> torch.Tensor:
    z = F.linear(x, p.down)
    return F.linear(F.layer_norm(z, (p.rank,), p.norm.weight, p.norm.bias, p.norm.eps), p.up)


def test_forward_and_bottleneck_hooks(projection):
    x = torch.randn(2, 3, 12)
    seen = {}
    for point in (projection.bottleneck, projection.bottleneck_normed, projection.norm.norm_normalized):
        point.add_hook(lambda t, hook, name=point.value.name: seen.update({name: t}))
    out = projection(x)
    torch.testing.assert_close(out, formula(projection, x), rtol=1e-5, atol=1e-5)
    z = F.linear(x, projection.down)
    torch.testing.assert_close(seen["bottleneck"], z)
    normalized = F.layer_norm(z, (5,), eps=1e-5)
    torch.testing.assert_close(seen["norm_normalized"], normalized, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["bottleneck_normed"], normalized * projection.norm.weight + projection.norm.bias,
                               rtol=1e-5, atol=1e-5)
    assert projection.bottleneck.value.layout_text == "Bottleneck [batch seq rank]"
    assert projection.norm.norm_normalized.value.layout_text == "Bottleneck [batch seq rank]"


def test_a_bottleneck_write_flows_on(projection):
    x = torch.randn(1, 4, 12)
    projection.bottleneck.add_hook(lambda t, hook: t * 3 + 1)
    z = F.linear(x, projection.down) * 3 + 1
    expected = F.linear(F.layer_norm(z, (5,), projection.norm.weight, projection.norm.bias, 1e-5), projection.up)
    torch.testing.assert_close(projection(x), expected, rtol=1e-5, atol=1e-5)


def test_head_results_sum_to_the_output(projection):
    heads = torch.randn(2, 3, 4, 3)  # [batch seq num_heads head_dim], 4·3 = 12 inputs
    results = projection.head_results(heads)
    torch.testing.assert_close(results.sum(-2) + projection.out_bias(), formula(projection, heads.flatten(-2)),
                               rtol=1e-5, atol=1e-5)
    # Head by head: the frozen-scale LayerNorm makes each term that head's own bottleneck share.
    z_heads = torch.einsum("bshd,rhd->bshr", heads, projection.down.view(5, 4, 3))
    z = z_heads.sum(-2, keepdim=True)
    scale = z.var(-1, unbiased=False, keepdim=True).add(1e-5).sqrt()
    own = (z_heads - z_heads.mean(-1, keepdim=True)) / scale * projection.norm.weight @ projection.up.T
    torch.testing.assert_close(results, own, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cap", [0.0, 0.5, 30.0])
def test_soft_cap(cap):
    scores = torch.randn(2, 3, 4, 4) * 5
    softcap = SoftCap(cap)
    seen = {}
    softcap.attention_raw_scores.add_hook(lambda t, hook: seen.update({"raw": t}))
    out = softcap(scores)
    torch.testing.assert_close(seen["raw"], scores)
    expected = scores if cap == 0 else torch.tanh(scores / cap) * cap
    torch.testing.assert_close(out, expected)
    if cap:
        assert out.abs().max() <= cap


def test_soft_cap_refuses_a_negative_cap():
    with pytest.raises(ValueError, match="soft cap must be >= 0"):
        SoftCap(-1.0)
