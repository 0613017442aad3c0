"""Property-based tests over random small configs and inputs, for both families.

For every drawn config and input: the forward equals the reference bit for bit (transformers'
ArceeForCausalLM, "sdpa" for the fused path and "eager" for the explicit one; the transcribed alpha-er
reference in tests/conftest.py), and so does a cache of every value; the cache identities hold exactly; a
sequence gives the same logits alone or in a batch, and padded or not; and any input at all either
runs or is refused with a ValueError, never another exception.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hooked_models import HookedAlphaEr, HookedArcee

# Factories from conftest are stateless, so sharing them across examples is safe.
PROPERTY = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected|: the 'relative' of 'within 1e-5 relative'."""
    return float((actual - expected).abs().max() / expected.abs().max())


def draw_tokens(data, vocab: int, batch: int, seq: int) -> torch.Tensor:
    seed = data.draw(st.integers(0, 2**16), label="token seed")
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- configs
@st.composite
def arcee_configs(draw):
    """Overrides of conftest's TINY_ARCEE: any grouping of heads, widths unrelated to each other,
    default or YaRN rotary (with and without an explicit factor)."""
    kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rope = draw(st.one_of(
        st.builds(lambda theta: {"rope_type": "default", "rope_theta": theta}, st.sampled_from([100.0, 10000.0, 5e5])),
        st.builds(lambda factor, original, theta: {"rope_type": "yarn", "factor": factor, "rope_theta": theta,
                                                   "original_max_position_embeddings": original},
                  st.sampled_from([2.0, 4.0, 20.0]), st.sampled_from([8, 16, 32]), st.sampled_from([1e4, 5e5])),
    ))
    return dict(
        num_hidden_layers=draw(st.integers(1, 2)), num_key_value_heads=kv_heads, num_attention_heads=kv_heads * group,
        # transformers requires hidden_size % num_heads == 0 (head_dim itself is free).
        head_dim=draw(st.sampled_from([2, 4, 6, 8])), hidden_size=kv_heads * group * draw(st.integers(1, 6)),
        intermediate_size=draw(st.integers(2, 32)), vocab_size=draw(st.integers(3, 64)),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])), tie_word_embeddings=draw(st.booleans()),
        max_position_embeddings=64, rope_parameters=rope,
    )


@st.composite
def alpha_er_configs(draw):
    """Overrides of conftest's TINY_ALPHA_ER: one to eight experts, ranks below and above the width,
    the soft cap on, tight, or off."""
    experts, heads = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 3, 4]))
    return dict(
        n_layer=draw(st.integers(1, 2)), mlp_experts=experts, block_size=experts * draw(st.integers(1, 4)),
        n_head=heads, n_embd=heads * draw(st.sampled_from([2, 4, 6])), ffn_dim=experts * draw(st.integers(1, 6)),
        attn_rank=draw(st.integers(1, 12)), lm_head_rank=draw(st.integers(1, 12)),
        attn_soft_cap=draw(st.sampled_from([0.0, 2.0, 30.0])), vocab_size=draw(st.integers(3, 64)),
        layer_norm_eps=draw(st.sampled_from([1e-5, 1e-3])),
    )


def check_cache_identities(model, tokens, mask=None, relu_squared: bool = False) -> torch.Tensor:
    """layer_input + attention_output + mlp_output == layer_output, bit for bit, in every layer
    (and mlp_neurons == relu(mlp_pre_activation)² for Arcee); returns the cached run's logits."""
    logits, cache = model.run_with_cache(tokens, attention_mask=mask)
    for i in range(model.cfg.n_layers):
        total = cache[f"layers.{i}.layer_input"] + cache[f"layers.{i}.self_attn.attention_output"] \
            + cache[f"layers.{i}.mlp.mlp_output"]
        assert torch.equal(total, cache[f"layers.{i}.layer_output"]), f"layer {i}"
        if relu_squared:
            pre = cache[f"layers.{i}.mlp.mlp_pre_activation"]
            assert torch.equal(cache[f"layers.{i}.mlp.mlp_neurons"], torch.relu(pre) ** 2), f"layer {i}"
    return logits


# --------------------------------------------------------------------------------------------- Arcee
@PROPERTY
@given(overrides=arcee_configs(), batch=st.integers(1, 3), seq=st.integers(1, 24), data=st.data())
def test_arcee_equals_transformers_and_its_identities_hold(hf_arcee_factory, explicit_attention, overrides, batch,
                                                           seq, data):
    oracle = hf_arcee_factory(seed=data.draw(st.integers(0, 99), label="weights seed"), **overrides)
    model = HookedArcee.from_hf(oracle)
    tokens = draw_tokens(data, overrides["vocab_size"], batch, seq)
    with torch.no_grad():
        # The same operations in the same order: the fused path is transformers' "sdpa" model and the
        # explicit path (taken when a hook reads the scores) its "eager" one, bit for bit; a cache of
        # every value is the explicit path (reading a value changes no bit).
        eager = oracle(tokens).logits
        assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=explicit_attention), eager)
        assert torch.equal(check_cache_identities(model, tokens, relu_squared=True), eager)
        oracle.set_attn_implementation("sdpa")
        assert torch.equal(model(tokens), oracle(tokens).logits)


@PROPERTY
@given(overrides=arcee_configs(), lengths=st.lists(st.integers(1, 16), min_size=1, max_size=4), data=st.data())
def test_arcee_is_batch_width_and_padding_invariant(hf_arcee_factory, explicit_attention, overrides, lengths, data):
    """Each prompt alone equals its row in a padded batch, padding on either side with any pad id."""
    model = HookedArcee.from_hf(hf_arcee_factory(seed=1, **overrides))
    vocab = overrides["vocab_size"]
    prompts = [draw_tokens(data, vocab, 1, n)[0] for n in lengths]
    side = data.draw(st.sampled_from(["left", "right"]), label="padding side")
    width = max(lengths) + data.draw(st.integers(0, 3), label="extra padding")
    ids = draw_tokens(data, vocab, len(prompts), width)  # the padding holds random ids: they must not matter
    mask = torch.zeros_like(ids)
    spans = [slice(0, n) if side == "right" else slice(width - n, width) for n in lengths]
    for row, (prompt, span) in enumerate(zip(prompts, spans)):
        ids[row, span], mask[row, span] = prompt, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for row, (prompt, span) in enumerate(zip(prompts, spans)):
            assert relative_error(batched[row, span], model(prompt[None])[0]) < 1e-5
        explicit = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=explicit_attention)
        assert torch.equal(check_cache_identities(model, ids, mask, relu_squared=True), explicit)


# ------------------------------------------------------------------------------------------ alpha-er
@PROPERTY
@given(overrides=alpha_er_configs(), batch=st.integers(1, 3), data=st.data())
def test_alpha_er_equals_the_reference_and_its_identities_hold(reference_alpha_er_factory, overrides, batch, data):
    reference = reference_alpha_er_factory(data.draw(st.integers(0, 99), label="weights seed"), **overrides)
    model = HookedAlphaEr.from_reference(reference)
    experts, block = overrides["mlp_experts"], overrides["block_size"]
    seq = experts * data.draw(st.integers(1, block // experts), label="windows")  # lengths alpha-er computes at
    tokens = draw_tokens(data, overrides["vocab_size"], batch, seq)
    with torch.no_grad():
        # Every step is the reference's own kernel in the reference's order, cached or not: bit for bit.
        expected = reference(tokens)
        assert torch.equal(model(tokens), expected)
        assert torch.equal(check_cache_identities(model, tokens), expected)


@PROPERTY
@given(overrides=alpha_er_configs(), lengths=st.lists(st.integers(1, 32), min_size=1, max_size=4), data=st.data())
def test_alpha_er_is_batch_width_and_padding_invariant(reference_alpha_er_factory, overrides, lengths, data):
    """alpha-er's routing depends on the padded length T, so the invariance is: at a fixed T, a
    prompt's real positions do not depend on its batch, on the pad ids, or on the mask (right padding,
    the reference's own rule)."""
    reference = reference_alpha_er_factory(2, **overrides)
    model = HookedAlphaEr.from_reference(reference)
    block, vocab = overrides["block_size"], overrides["vocab_size"]
    lengths = [min(n, block) for n in lengths]
    prompts = [draw_tokens(data, vocab, 1, n)[0] for n in lengths]
    ids = draw_tokens(data, vocab, len(prompts), block)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)], mask[row, : len(prompt)] = prompt, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        unmasked = model(ids)
        for row, prompt in enumerate(prompts):
            zero_padded = torch.zeros(1, block, dtype=torch.long)
            zero_padded[0, : len(prompt)] = prompt
            real = slice(0, len(prompt))
            alone = reference(zero_padded)[0, real]  # the reference's generate: pad with 0, read real positions
            assert relative_error(batched[row, real], alone) < 1e-5
            assert relative_error(unmasked[row, real], alone) < 1e-5
        assert torch.equal(check_cache_identities(model, ids, mask), batched)


# ----------------------------------------------------------------------------------- any input at all
@st.composite
def arbitrary_inputs(draw, vocab: int, lengths: list[int]):
    """Tensors of any rank, size, dtype and range (mostly [batch seq] integer ids of a length the
    model computes at, so that the forward is reached often), with masks that may or may not fit."""
    rank = draw(st.sampled_from([2, 2, 2, 2, 0, 1, 3]))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank)))
    if rank == 2 and draw(st.integers(0, 3)):
        shape = (draw(st.integers(1, 3)), draw(st.sampled_from(lengths)))
    dtype = draw(st.sampled_from([torch.long, torch.long, torch.long, torch.int32, torch.uint8, torch.float32,
                                  torch.bool]))
    numel = int(torch.tensor(shape).prod()) if shape else 1
    ids = st.integers(0, vocab - 1)
    if draw(st.booleans()):  # some ids outside the vocabulary, on either side
        ids = ids | st.sampled_from([-1, -vocab, vocab, vocab + 7])
    tokens = torch.tensor(draw(st.lists(ids, min_size=numel, max_size=numel)), dtype=torch.long)
    tokens = tokens.reshape(shape).to(dtype)
    mask = draw(st.one_of(
        st.none(),
        st.lists(st.sampled_from([0, 1, 1, 1]), min_size=numel, max_size=numel).map(
            lambda v: torch.tensor(v, dtype=torch.long).reshape(shape)),
        st.builds(lambda v: torch.full(shape, v), st.sampled_from([0, 2, 0.5])),
        st.builds(lambda n: torch.ones(n, dtype=torch.long), st.integers(0, 5)),
    ))
    return tokens, mask


def runs_or_refuses(model, tokens, mask, vocab: int):
    try:
        logits = model(tokens, attention_mask=mask)
    except ValueError as error:
        assert str(error)  # a message, not an empty ValueError
        return
    assert logits.shape == (*tokens.shape, vocab) and bool(torch.isfinite(logits).all())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_input_runs_or_is_a_value_error(tiny_arcee, data):
    tokens, mask = data.draw(arbitrary_inputs(97, [1, 2, 3, 5, 16, 17]))
    with torch.no_grad():
        runs_or_refuses(tiny_arcee, tokens, mask, 97)


@pytest.fixture(scope="module")
def tiny_alpha_er():
    from hooked_models.families.alpha_er import AlphaErConfig

    torch.manual_seed(0)
    model = HookedAlphaEr(AlphaErConfig(vocab_size=11, block_size=8, n_layer=1, n_embd=8, n_head=2, ffn_dim=8,
                                        mlp_experts=2, lm_head_rank=3, attn_rank=3))
    with torch.no_grad():  # the factored and expert weights start uninitialized (torch.empty)
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_alpha_er_input_runs_or_is_a_value_error(tiny_alpha_er, data):
    tokens, mask = data.draw(arbitrary_inputs(11, [2, 4, 8, 3, 10]))
    with torch.no_grad():
        runs_or_refuses(tiny_alpha_er, tokens, mask, 11)
