"""Split inputs (TransformerLens's use_split_qkv_input, use_attn_in, use_hook_mlp_in) on both families.

Each head's query, key and value reads its own copy of the stream entering the block (before
input_layernorm), and the MLP branch its own copy of layer_mid (before post_attention_layernorm).
Checked here: unwritten copies leave the logits bit for bit; a write to one copy moves that head
alone, by exactly what an independent computation through the model's own modules gives (the norm,
then the whole projection of the written stream, head sliced out); the gradient at a copy is the
gradient of that computation; the switches, names and printout.
"""

import pytest
import torch

SPLIT = ("attention_query_inputs", "attention_key_inputs", "attention_value_inputs", "attention_inputs",
         "mlp_residual_input")
PARTS = {"q": "attention_query_inputs", "k": "attention_key_inputs", "v": "attention_value_inputs"}


def tokens(model, batch=2, seed=0):
    seq = 8  # a multiple of alpha-er's tiny expert count
    return torch.randint(3, model.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("values", [SPLIT[:3], SPLIT[3:4], SPLIT[4:], SPLIT], ids=["qkv", "attn_in", "mlp_in", "all"])
@pytest.mark.parametrize("explicit", [False, True], ids=["fused", "explicit"])
def test_unwritten_copies_leave_the_logits_bit_for_bit(tl_model, values, explicit, explicit_attention):
    ids = tokens(tl_model)
    others = explicit_attention if explicit else []
    with torch.no_grad():
        plain = tl_model.run_with_hooks(ids, fwd_hooks=others)
        seen = []
        read = [(lambda name: name.endswith(values), lambda t, hook: seen.append(hook.name))]
        split = tl_model.run_with_hooks(ids, fwd_hooks=others + read)
    assert len(seen) == 2 * len(values)  # the copies were made, on both layers
    assert torch.equal(split, plain)


@pytest.mark.parametrize("part", "qkv")
def test_a_write_to_one_copy_moves_that_head_alone(tl_model, part, split_oracle):
    reference_heads, projected_name = split_oracle
    model, ids, layer, copy = tl_model, tokens(tl_model), 1, 1
    g = torch.Generator().manual_seed(1)
    delta = torch.randn(ids.shape[0], ids.shape[1], model.cfg.d_model, generator=g)

    def write(t, hook):
        t = t.clone()
        t[:, :, copy] += delta
        return t

    with torch.no_grad():
        _, before = model.run_with_cache(ids, names_filter=[projected_name(model, layer, part), f"layers.{layer}.layer_input"])
        with model.hooks(fwd_hooks=[(f"layers.{layer}.self_attn.{PARTS[part]}", write)]):
            _, after = model.run_with_cache(ids, names_filter=[projected_name(model, layer, part)])
        expected = reference_heads(model, layer, part, before[f"layers.{layer}.layer_input"] + delta)[:, copy]
    old, new = before[projected_name(model, layer, part)], after[projected_name(model, layer, part)]
    others = [n for n in range(new.shape[1]) if n != copy]
    assert torch.equal(new[:, others], old[:, others])  # every other head, bit for bit
    torch.testing.assert_close(new[:, copy], expected, rtol=1e-5, atol=1e-5)
    assert (new[:, copy] - old[:, copy]).abs().max() > 1e-2  # the write reached it


def test_attention_inputs_feed_queries_keys_and_values(tl_model, split_oracle):
    """One copy per query head; key/value head j reads the copy of its group's first query head."""
    reference_heads, projected_name = split_oracle
    model, ids, layer = tl_model, tokens(tl_model), 0
    groups = model.cfg.n_heads // model.cfg.n_key_value_heads
    delta = torch.randn(ids.shape[0], ids.shape[1], model.cfg.d_model, generator=torch.Generator().manual_seed(2))
    names = [projected_name(model, layer, part) for part in "qkv"]
    with torch.no_grad():
        _, before = model.run_with_cache(ids, names_filter=names + [f"layers.{layer}.layer_input"])
        stream = before[f"layers.{layer}.layer_input"] + delta
        for head in (0, 1):  # under GQA (2 query heads per kv head) head 0 leads its group, head 1 does not

            def write(t, hook, head=head):
                t = t.clone()
                t[:, :, head] += delta
                return t

            with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_attn_in", write)]):
                _, after = model.run_with_cache(ids, names_filter=names)
            for part, name in zip("qkv", names):
                moved = {n for n in range(after[name].shape[1]) if not torch.equal(after[name][:, n], before[name][:, n])}
                index = head if part == "q" else head // groups
                expected = {index} if part == "q" or head % groups == 0 else set()
                assert moved == expected, (head, part)
                if moved:
                    torch.testing.assert_close(after[name][:, index],
                                               reference_heads(model, layer, part, stream)[:, index],
                                               rtol=1e-5, atol=1e-5)


def test_mlp_residual_input_is_what_the_mlp_branch_reads(tl_model):
    model, ids = tl_model, tokens(tl_model)
    delta = torch.randn(ids.shape[0], ids.shape[1], model.cfg.d_model, generator=torch.Generator().manual_seed(3))
    names = ["layers.0.layer_mid", "layers.0.mlp.mlp_output", "layers.0.layer_output"]
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=names)
        with model.hooks(fwd_hooks=[("blocks.0.hook_mlp_in", lambda t, hook: t + delta)]):
            _, written = model.run_with_cache(ids, names_filter=names)
        block = model.layers[0]
        expected = block.mlp(block.post_attention_layernorm(cache["layers.0.layer_mid"] + delta))
    assert torch.equal(written["layers.0.layer_mid"], cache["layers.0.layer_mid"])  # the residual is not moved
    torch.testing.assert_close(written["layers.0.mlp.mlp_output"], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(written["layers.0.layer_output"], written["layers.0.layer_mid"] + written["layers.0.mlp.mlp_output"])


@pytest.mark.parametrize("part", "qkv")
def test_the_gradient_at_a_copy_is_the_gradient_through_that_head_alone(tl_model, part, split_oracle):
    """d metric / d (copy n) equals d metric / d delta at delta = 0, where delta moves the stream that
    head n's `part` is computed from (independently: a hook on that part's projections)."""
    reference_heads, projected_name = split_oracle
    model, ids, layer, copy = tl_model, tokens(tl_model), 1, 1

    def metric(logits):
        return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()

    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=f"layers.{layer}.layer_input")
    stream = cache[f"layers.{layer}.layer_input"]
    seen = {}

    def keep(t, hook):
        seen["copy"] = t

    with model.hooks(fwd_hooks=[(f"layers.{layer}.self_attn.{PARTS[part]}", keep)]):
        (at_copy,) = torch.autograd.grad(metric(model(ids)), seen["copy"])
    delta = torch.zeros_like(stream, requires_grad=True)

    def replace(t, hook):
        t = t.clone()
        t[:, copy] = reference_heads(model, layer, part, stream + delta)[:, copy]
        return t

    with model.hooks(fwd_hooks=[(projected_name(model, layer, part), replace)]):
        (expected,) = torch.autograd.grad(metric(model(ids)), delta)
    torch.testing.assert_close(at_copy[:, :, copy], expected, rtol=1e-4, atol=1e-5)
    assert expected.abs().max() > 1e-3
    others = [n for n in range(at_copy.shape[2]) if n != copy]
    assert at_copy[:, :, others].abs().max() > 1e-3  # every copy has its own gradient


def test_reading_the_copies_leaves_the_stream_gradient(tl_model):
    model, ids = tl_model, tokens(tl_model)
    grads = []
    for hooks in ([], [(lambda name: name.endswith(SPLIT), lambda t, hook: None)]):
        seen = {}

        def keep(t, hook):
            seen["x"] = t

        with model.hooks(fwd_hooks=[("layers.0.layer_input", keep)] + hooks):
            logits = model(ids)
            grads.append(torch.autograd.grad(logits[:, -1, 3].sum(), seen["x"])[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_switches_names_and_printout(tl_model):
    model = tl_model
    text = repr(model)
    assert "(attention_query_inputs) -> PerHeadResidual [batch seq num_heads hidden_size]" in text
    assert "(attention_key_inputs) -> PerKVHeadResidual [batch seq num_kv_heads hidden_size]" in text
    assert "(mlp_residual_input) -> Residual [batch seq hidden_size]" in text
    # TransformerLens 4.x hangs the split inputs on the attention, 3.x on the block: both resolve.
    for short, value in (("q_input", "attention_query_inputs"), ("k_input", "attention_key_inputs"),
                         ("v_input", "attention_value_inputs"), ("attn_in", "attention_inputs")):
        for alias in (f"blocks.1.attn.hook_{short}", f"blocks.1.hook_{short}"):
            assert model.resolve_hook_name(alias)[0] == f"layers.1.self_attn.{value}"
    assert model.resolve_hook_name("blocks.1.hook_mlp_in")[0] == "layers.1.mlp_residual_input"
    for flag in ("use_split_qkv_input", "use_attn_in", "use_hook_mlp_in", "use_attn_result"):
        assert getattr(model.cfg, flag) is False
        getattr(model, f"set_{flag}")(True)
        assert getattr(model.cfg, flag) is True
        getattr(model, f"set_{flag}")(False)
    rows = {r.name: r for r in model.support()}
    assert rows["layers.0.self_attn.attention_key_inputs"].tl_name == "blocks.0.attn.hook_k_input"
