"""Every dtype against transformers: the same operations in the same order give the same logits,
bit for bit (left-padded batches included).

Both sides are loaded from the same checkpoint with `from_pretrained(dtype=...)`, as a user would
(transformers then keeps its rotary frequencies in float32; `.to(bfloat16)` on a built model would
round them, which is a different model). Our fused path calls the kernel transformers' "sdpa"
attention calls, our explicit path (taken when scores are hooked) mirrors its "eager" one, softmax
in float32, and the norms compute in float32 as `LlamaRMSNorm` does.
"""

import pytest
import torch
from transformers import ArceeForCausalLM

from hooked_models import HookedArcee


def _checkpoint(tmp_path, hf_arcee_factory) -> str:
    path = tmp_path / "arcee"
    hf_arcee_factory(seed=2).save_pretrained(path)
    return str(path)


def rel_error(actual, expected) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logits_are_transformers_bit_for_bit_in_every_dtype(tmp_path, hf_arcee_factory, explicit_attention, dtype):
    path = _checkpoint(tmp_path, hf_arcee_factory)
    model = HookedArcee.from_pretrained(path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    ids = torch.randint(3, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding on one row
    for implementation, run in [("sdpa", lambda m: m(ids, attention_mask=mask)),
                                ("eager", lambda m: m.run_with_hooks(ids, attention_mask=mask, fwd_hooks=explicit_attention))]:
        hf = ArceeForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=implementation).eval()
        with torch.no_grad():
            # Our positions count from each row's first real token; transformers' from 0 unless told.
            expected = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
            actual = run(model)
        assert actual.dtype == dtype
        real = mask.bool()
        assert torch.equal(actual[real], expected[real]), (implementation, rel_error(actual[real], expected[real]))


def test_norms_and_softmax_compute_in_float32(tiny_hf_arcee):
    """A bfloat16 model's norm scale and attention pattern come from float32 arithmetic: the scale is
    float32 itself, and the pattern is the float32 softmax of the scores, rounded once."""
    model = HookedArcee.from_hf(tiny_hf_arcee, dtype=torch.bfloat16)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    scale = cache["layers.0.input_layernorm.norm_scale"]
    assert scale.dtype == torch.float32
    resid = cache["layers.0.layer_input"].float()
    torch.testing.assert_close(scale, (resid.pow(2).mean(-1, keepdim=True) + model.cfg.rms_norm_eps).sqrt())
    pattern = cache["layers.0.self_attn.attention_probabilities"]
    scores = cache["layers.0.self_attn.attention_scores"]
    assert pattern.dtype == scores.dtype == torch.bfloat16
    assert torch.equal(pattern, torch.softmax(scores.float(), dim=-1).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alpha_er_is_the_reference_bit_for_bit_in_half_precision(reference_alpha_er_factory, dtype):
    """alpha-er in bfloat16 and float16 against the reference cast to the same dtype: the same kernels
    in the same order, so the same logits, plain or with every value cached."""
    from hooked_models import HookedAlphaEr

    reference = reference_alpha_er_factory(0).to(dtype)
    model = HookedAlphaEr.from_reference(reference)
    assert {p.dtype for p in model.parameters()} == {dtype}
    ids = torch.randint(0, reference.cfg.vocab_size, (2, reference.cfg.block_size),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids)
        assert torch.equal(model(ids), expected)
        assert torch.equal(model.run_with_cache(ids)[0], expected)


# ------------------------------------------------------------------------------------- dtype names
@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("fp16", torch.float16), ("float16", torch.float16),
                                         ("torch.float32", torch.float32), ("FP32", torch.float32),
                                         (torch.bfloat16, torch.bfloat16)])
def test_dtype_names_are_taken_wherever_a_dtype_is(tiny_hf_arcee, reference_alpha_er_factory, name, dtype):
    from hooked_models import ArceeConfig, HookedAlphaEr

    models = [HookedArcee.from_pretrained("embedded", dtype=name), HookedArcee.from_hf(tiny_hf_arcee, dtype=name),
              HookedAlphaEr.from_pretrained("embedded", dtype=name),
              HookedAlphaEr.from_reference(reference_alpha_er_factory(), dtype=name),
              HookedArcee(ArceeConfig(num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                                      vocab_size=11, intermediate_size=8, max_position_embeddings=16, dtype=name))]
    moved = HookedArcee.from_hf(tiny_hf_arcee).to(name)  # nn.Module.to, with names
    for model in [*models, moved]:
        assert {p.dtype for p in model.parameters()} == {dtype} and model.cfg.dtype == dtype
    with torch.no_grad():  # the model runs in it
        assert moved(torch.tensor([[1, 2, 3]])).dtype == dtype


@pytest.mark.parametrize("bad", ["int8", "bfloat", torch.int64, "cuda"])
def test_a_bad_dtype_is_a_clear_error_listing_the_names(tiny_hf_arcee, bad):
    from hooked_models import HookedAlphaEr

    for load in (lambda: HookedArcee.from_pretrained("embedded", dtype=bad),
                 lambda: HookedArcee.from_hf(tiny_hf_arcee, dtype=bad),
                 lambda: HookedAlphaEr.from_pretrained("embedded", dtype=bad)):
        with pytest.raises(ValueError, match=rf"dtype {bad!r} is not a floating-point dtype.*'bfloat16', 'bf16'"):
            load()
