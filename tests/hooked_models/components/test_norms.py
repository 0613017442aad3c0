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


# ------------------------------------------------------------------------------------------ frozen
def _detach(t, hook):
    return t.detach()


@pytest.mark.parametrize("norm_class", [RMSNorm, LayerNorm])
def test_a_detached_scale_of_equal_value_freezes_the_gradient_and_keeps_the_bits(norm_class):
    """TransformerLens's idiom for attribution, a hook returning `scale.detach()`, is honoured although
    the value is unchanged: the output keeps its bits and the gradient is the analytic one with the scale
    a constant, weight / scale (LayerNorm: after the centring, which does not depend on the scale)."""
    torch.manual_seed(0)
    norm = norm_class(16, 1e-5)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape))
    x = (torch.randn(2, 5, 16) * 3 + 1).requires_grad_()
    upstream = torch.randn(2, 5, 16)
    plain = norm(x)
    free = torch.autograd.grad((plain * upstream).sum(), x)[0]
    norm.norm_scale.add_hook(_detach)
    try:
        frozen_out = norm(x)
        frozen = torch.autograd.grad((frozen_out * upstream).sum(), x)[0]
    finally:
        norm.norm_scale.remove_hooks()
    assert torch.equal(frozen_out, plain)
    x32 = x.detach()
    centred = x32 - x32.mean(-1, keepdim=True) if norm_class is LayerNorm else x32
    scale = (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    expected = upstream * norm.weight.detach() / scale
    if norm_class is LayerNorm:
        expected = expected - expected.mean(-1, keepdim=True)
    torch.testing.assert_close(frozen, expected, rtol=1e-6, atol=1e-6)
    assert (free - frozen).abs().max() > 1e-2  # the unfrozen gradient is another thing


def _constant_scale_forward(norm):
    """The norm as a plain function with its scale a constant (computed from x, then detached): an
    oracle for the frozen gradient that goes through no hook."""
    def forward(x):
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True) if isinstance(norm, LayerNorm) else x32
        scale = (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt().detach()
        out = (centred / scale).to(x.dtype) * norm.weight
        return out + norm.bias if isinstance(norm, LayerNorm) else out
    return forward


def _input_gradient(model, tokens, upstream, fwd_hooks=()):
    """Logits, and the gradient of logits · upstream with respect to the first layer's input."""
    grads = {}

    def leaf(t, hook):
        grads["x"] = t.detach().requires_grad_()
        return grads["x"]

    logits = model.run_with_hooks(tokens, fwd_hooks=[("layers.0.layer_input", leaf), *fwd_hooks])
    return logits, torch.autograd.grad((logits * upstream).sum(), grads["x"])[0]


def test_every_scale_frozen_by_a_detach_gives_the_constant_scale_gradient(tl_model):
    """Every norm of the model (alpha-er: its bottleneck norms and the lm_head's too) frozen by a hook on
    its scale: the logits stay bit for bit, and the gradient equals the one taken with every norm
    replaced by a hook-free function of constant scale."""
    model = tl_model
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(2, 8, model.cfg.d_vocab, generator=torch.Generator().manual_seed(2))
    plain_logits, free = _input_gradient(model, tokens, upstream)
    frozen_hooks = [(lambda name: name.endswith("norm_scale"), _detach)]
    logits, frozen = _input_gradient(model, tokens, upstream, frozen_hooks)
    assert torch.equal(logits, plain_logits)
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))]
    assert len(norms) >= 2 * model.cfg.n_layers + 1
    try:
        for norm in norms:
            norm.forward = _constant_scale_forward(norm)
        oracle_logits, oracle = _input_gradient(model, tokens, upstream)
    finally:
        for norm in norms:
            del norm.forward
    torch.testing.assert_close(oracle_logits, logits, rtol=1e-5, atol=1e-5)
    # float32 rounding: the model divides by the scale where the oracle does too, but sums in its own order
    assert (frozen - oracle).abs().max() <= 1e-5 * oracle.abs().max()
    assert (free - frozen).abs().max() > 1e-2 * frozen.abs().max()


def test_attention_patterns_frozen_by_a_detach_give_the_constant_pattern_gradient(tl_model):
    """A hook returning `pattern.detach()` freezes the patterns: the logits stay bit for bit and the
    gradient equals the one taken with each pattern written as a constant (the clean run's, cached)."""
    model = tl_model
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(2, 8, model.cfg.d_vocab, generator=torch.Generator().manual_seed(2))
    is_pattern = lambda name: name.endswith("attention_probabilities")  # noqa: E731
    with torch.no_grad():
        plain_logits, cache = model.run_with_cache(tokens, names_filter=is_pattern)
    _, free = _input_gradient(model, tokens, upstream, [(is_pattern, lambda t, hook: None)])
    logits, frozen = _input_gradient(model, tokens, upstream, [(is_pattern, _detach)])
    assert torch.equal(logits, plain_logits)
    _, oracle = _input_gradient(model, tokens, upstream, [(is_pattern, lambda t, hook: cache[hook.name].clone())])
    torch.testing.assert_close(frozen, oracle, rtol=1e-6, atol=1e-6)
    assert (free - frozen).abs().max() > 1e-2 * frozen.abs().max()


def test_transformer_lens_idiom_on_hook_scale_freezes_the_final_norm(tl_model):
    """TransformerLens's own names work the same: `ln_final.hook_scale` returning `scale.detach()` freezes
    the final norm exactly as a detach on its standard name does, and the gradient then differs from the
    unfrozen one (the issue's report: before, the write was compared by value and ignored)."""
    model = tl_model
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(2, 8, model.cfg.d_vocab, generator=torch.Generator().manual_seed(2))
    _, free = _input_gradient(model, tokens, upstream)
    _, by_tl_name = _input_gradient(model, tokens, upstream, [("ln_final.hook_scale", _detach)])
    _, by_name = _input_gradient(model, tokens, upstream, [("norm.norm_scale", _detach)])
    assert torch.equal(by_tl_name, by_name)
    assert (free - by_name).abs().max() > 1e-3 * by_name.abs().max()


@pytest.mark.parametrize("equal_somewhere", [True, False])
def test_a_written_scale_gives_the_same_values_with_a_gradient_or_without(equal_somewhere):
    """Where a hook writes the scale, the output is x / written · weight, and the reference's bits where
    the written scale is the computed one; without a gradient (the decomposition's batched forwards) it
    is the same, bit for bit, as with one (only the gradient's exact zero and, where no written scale is
    the computed one, the reference's product are left out)."""
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(16))
    x = torch.randn(2, 6, 16) * 3 + 1
    with torch.no_grad():
        reference = norm(x)

    def write(t, hook):
        out = t * 1.5
        if equal_somewhere:
            out[:, ::2] = t[:, ::2]
        return out

    norm.norm_scale.add_hook(write)
    try:
        with torch.no_grad():
            fast = norm(x)
        slow = norm(x.clone().requires_grad_()).detach()
    finally:
        norm.norm_scale.remove_hooks()
    scale = (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    expected = norm.weight.detach() * (x / (scale * 1.5))
    if equal_somewhere:
        expected[:, ::2] = reference[:, ::2]
    assert torch.equal(fast, expected) and torch.equal(slow, expected)
