"""The attention core: the fused path and the explicit one give the same numbers, the fused one is
taken exactly when nobody looks at the scores or the pattern, and the cache holds the very tensors
the forward computed (references, not copies)."""

import pytest
import torch
import torch.nn.functional as F

from hooked_models import HookedAlphaEr, HookedArcee


def rel_close(actual, expected, rtol):
    scale = expected.abs().max()
    torch.testing.assert_close(actual, expected, rtol=0, atol=rtol * float(scale))


def tokens(batch, seq, vocab, seed=0):
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def count_fused(monkeypatch):
    """Counts calls of F.scaled_dot_product_attention (the fused path) while the test runs."""
    calls = []
    fused = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


def identity_write(tensor, hook):
    return tensor  # a "write" that changes nothing: forces the explicit path, not the numbers


def read_only(tensor, hook):
    return None


@pytest.mark.parametrize("hook_value", ["attention_scores", "attention_probabilities"])
@pytest.mark.parametrize("hook_fn", [identity_write, read_only])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_and_explicit_paths_agree(hf_arcee_factory, count_fused, hook_value, hook_fn, padded):
    model = HookedArcee.from_hf(hf_arcee_factory(seed=3))  # GQA: 10 query heads over 2 key/value heads
    ids = tokens(3, 24, model.cfg.vocab_size)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # left padding
        mask[1, -7:] = 0  # right padding
    with torch.no_grad():
        fused = model(ids, attention_mask=mask)
        assert len(count_fused) == model.cfg.num_layers
        hooks = [(f"layers.{i}.self_attn.{hook_value}", hook_fn) for i in range(model.cfg.num_layers)]
        explicit = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=hooks)
    assert len(count_fused) == model.cfg.num_layers  # the hooked run never took the fused path
    rel_close(explicit, fused, 1e-5)


def test_only_the_hooked_layer_goes_explicit(hf_arcee_factory, count_fused):
    model = HookedArcee.from_hf(hf_arcee_factory(seed=4, num_hidden_layers=3))
    ids = tokens(2, 16, model.cfg.vocab_size)
    with torch.no_grad():
        model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_pattern", read_only)])
        assert len(count_fused) == 2
        # Hooks on other attention values (queries, keys, values, mixed heads) keep the fused path.
        others = [(f"layers.{i}.self_attn.{name}", read_only) for i in range(3)
                  for name in ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs")]
        model.run_with_hooks(ids, fwd_hooks=others)
        assert len(count_fused) == 2 + 3


def test_explicit_path_matches_the_fused_one_in_bfloat16(hf_arcee_factory, explicit_attention):
    model = HookedArcee.from_hf(hf_arcee_factory(seed=5).to(torch.bfloat16))
    ids = tokens(2, 32, model.cfg.vocab_size)
    with torch.no_grad():
        fused = model(ids).float()
        explicit = model.run_with_hooks(ids, fwd_hooks=explicit_attention).float()
    rel_close(explicit, fused, 2e-2)  # softmax in float32 either way; bf16 rounding differs by kernel


@pytest.mark.parametrize("model_name", ["arcee", "alpha-er"])
def test_cache_holds_the_computed_tensors_not_copies(model_name, hf_arcee_factory, reference_alpha_er_factory):
    if model_name == "arcee":
        model = HookedArcee.from_hf(hf_arcee_factory(seed=6))
        ids = tokens(2, 12, model.cfg.vocab_size)
    else:
        model = HookedAlphaEr.from_reference(reference_alpha_er_factory(seed=6))
        ids = tokens(2, model.cfg.mlp_experts * 2, model.cfg.vocab_size)
    seen: dict[str, int] = {}

    def record(tensor, hook):
        seen[hook.name] = tensor.data_ptr()

    with torch.no_grad(), model.hooks(fwd_hooks=[(lambda name: True, record)]):
        logits, cache = model.run_with_cache(ids)
    assert logits.data_ptr() == cache["logits"].data_ptr()
    assert set(cache.keys()) <= set(seen)
    for name in cache.keys():
        if cache[name].numel():
            assert cache[name].data_ptr() == seen[name], f"{name} was copied into the cache"


def test_no_weight_is_copied_or_relaid_per_forward(hf_arcee_factory):
    """No op of a forward (hooks included) copies a weight matrix: copies, clones and re-layouts of
    a tensor shaped like a 2-D parameter would show in the profile."""
    model = HookedArcee.from_hf(hf_arcee_factory(seed=7))
    weight_shapes = [list(p.shape) for p in model.parameters() if p.ndim == 2]
    copying = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::repeat_interleave"}
    with torch.no_grad(), torch.profiler.profile(record_shapes=True) as profile:
        model.run_with_cache(tokens(2, 8, model.cfg.vocab_size))
    copied = [(e.key, e.input_shapes) for e in profile.key_averages(group_by_input_shape=True)
              if e.key in copying and e.input_shapes and e.input_shapes[0] in weight_shapes]
    assert not copied, f"weights copied or re-laid out during a forward: {copied}"


@pytest.mark.parametrize("groups", [1, 2])
def test_a_pattern_shared_by_the_batch_mixes_as_matmul_does_bit_for_bit(groups):
    """A pattern expanded over the batch (a frozen one written back: stride 0) is read in place, one
    product per head, and the values not repeated: the same bits as matmul of the expanded pattern and
    the repeated values, on every row; a pattern of the batch's own rows takes matmul."""
    from hooked_models.components.attention import SelfAttention, repeat_kv

    attention = SelfAttention(4, 4 // groups, 8)
    generator = torch.Generator().manual_seed(0)
    pattern = torch.softmax(torch.randn(1, 4, 9, 9, generator=generator), -1)
    v = torch.randn(5, 4 // groups, 9, 8, generator=generator)
    shared = pattern.expand(5, -1, -1, -1)
    expected = torch.matmul(shared.contiguous(), repeat_kv(v, groups))
    assert torch.equal(attention.mix(shared, v), expected)
    own = torch.softmax(torch.randn(5, 4, 9, 9, generator=generator), -1)
    assert torch.equal(attention.mix(own, v), torch.matmul(own, repeat_kv(v, groups)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_rotary_has_transformers_bits_forward_and_backward(dtype, head_dim):
    """apply_rotary (the halves' second terms added in place, no rotated copy) against transformers'
    own apply_rotary_pos_emb: the same bits, and the same gradients' bits through autograd."""
    from transformers.models.arcee.modeling_arcee import apply_rotary_pos_emb

    from hooked_models.components.rotary import apply_rotary

    generator = torch.Generator().manual_seed(head_dim)
    x = (3 * torch.randn(2, 4, 9, head_dim, generator=generator)).to(dtype)
    angles = torch.randn(2, 9, head_dim // 2, generator=generator) * 5
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    upstream = torch.randn(2, 4, 9, head_dim, generator=generator).to(dtype)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = apply_rotary(ours_x, cos, sin)
    theirs, _ = apply_rotary_pos_emb(theirs_x, theirs_x, cos, sin)
    assert torch.equal(ours, theirs)
    ours.backward(upstream)
    theirs.backward(upstream)
    assert torch.equal(ours_x.grad, theirs_x.grad)
