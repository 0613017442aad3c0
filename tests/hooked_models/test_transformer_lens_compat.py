"""TransformerLens's own surface on the hooked models: names, weight views, the cache's
decompositions, direct logit attribution, gradients, weight processing. Every number is checked
against the model's own forward on random non-trivial weights (norm weights far from 1)."""

import pytest
import torch

from hooked_models.transformer_lens_compat import TRANSFORMER_LENS_4

close = dict(rtol=1e-5, atol=1e-5)


def tokens_for(model, batch=2, seq=8, seed=0):
    return torch.randint(0, model.cfg.d_vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def run(tl_model):
    tokens = tokens_for(tl_model)
    with torch.no_grad():  # every value, per-head results (on request) included
        logits, cache = tl_model.run_with_cache(tokens, names_filter=lambda name: True)
    return tl_model, tokens, logits, cache


@pytest.mark.skipif(not TRANSFORMER_LENS_4, reason="transformer_lens.model_protocol is new in TransformerLens 4.x")
def test_satisfies_transformer_lens_protocol(tl_model):
    from transformer_lens.model_protocol import TransformerLensModelWithWeights

    assert isinstance(tl_model, TransformerLensModelWithWeights)
    assert not tl_model.training


# ------------------------------------------------------------------------------------ names
# TransformerLens's per-head query/key/value hooks are [batch pos head d_head] (its docs); the standard
# layout is [batch head seq dim]. Every other alias has the standard layout.
TL_TRANSPOSED = ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k")


def test_every_alias_reads_the_same_value_in_transformer_lens_layout(run):
    model, tokens, _, cache = run
    assert len(model.aliases) > 20
    for alias, canonical in model.aliases.items():
        standard = cache[canonical]
        if alias.rpartition(".")[2] in TL_TRANSPOSED:
            batch, heads, seq, dim = standard.shape
            assert cache[alias].shape == (batch, seq, heads, dim), alias
            for b, h, p, d in ((0, 0, 0, 0), (batch - 1, heads - 1, seq - 1, dim - 1), (1, heads // 2, 3, 1)):
                assert cache[alias][b, p, h, d] == standard[b, h, p, d], alias
            expected = standard.transpose(1, 2)
        else:
            assert cache[alias] is standard, alias
            expected = standard
        seen = {}

        def read(tensor, hook, alias=alias):
            seen["tensor"], seen["name"] = tensor.detach().clone(), hook.name

        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=[(alias, read)])
        assert seen["name"] == alias
        # (close, not equal: with nobody reading the pattern, attention takes the fused path)
        torch.testing.assert_close(seen["tensor"], expected, **close)


def test_tuple_and_shorthand_lookups(run):
    model, _, _, cache = run
    last = model.cfg.n_layers - 1
    assert cache["resid_pre", 0] is cache["layers.0.layer_input"]
    assert cache["blocks.0.hook_resid_pre"] is cache["layers.0.layer_input"]
    assert cache["resid_post", -1] is cache[f"layers.{last}.layer_output"]
    torch.testing.assert_close(cache["k", 1], cache["blocks.1.attn.hook_k"])
    assert cache["k", 1].shape[-2] == model.cfg.n_key_value_heads
    assert cache["scale"] is cache["norm.norm_scale"]  # TransformerLens's ln_final.hook_scale
    assert cache["embed"] is cache["token_embeddings"]


def test_writes_through_aliases_are_mapped_back(run):
    """A write in TransformerLens's layout equals the same write in the standard layout."""
    model, tokens, _, _ = run
    for alias, canonical in model.aliases.items():
        _, value = model.resolve_hook_name(alias)
        if value is None or alias in ("hook_embed",):
            continue

        def edit_tl(tensor, hook):
            bump = torch.arange(tensor.numel(), dtype=tensor.dtype).view(tensor.shape) * 1e-3
            return tensor + bump

        def edit_standard(tensor, hook, value=value):
            bump = torch.arange(tensor.numel(), dtype=tensor.dtype).view(value.to_tl(tensor).shape) * 1e-3
            return tensor + value.from_tl(bump)

        with torch.no_grad():
            via_alias = model.run_with_hooks(tokens, fwd_hooks=[(alias, edit_tl)])
            via_canonical = model.run_with_hooks(tokens, fwd_hooks=[(canonical, edit_standard)])
            plain = model(tokens)
        torch.testing.assert_close(via_alias, via_canonical, rtol=0, atol=0)
        assert not torch.allclose(via_alias, plain), alias


def test_aliases_in_add_hook_hooks_and_names_filter(run):
    model, tokens, logits, cache = run
    seen = []
    model.add_hook("blocks.1.attn.hook_v", lambda t, hook: seen.append(t.shape))
    with torch.no_grad():
        model(tokens)
    model.reset_hooks()
    assert seen == [cache["blocks.1.attn.hook_v"].shape]
    with model.hooks(fwd_hooks=[("blocks.0.hook_mlp_out", lambda t, hook: torch.zeros_like(t))]):
        with torch.no_grad():
            zeroed = model(tokens)
    with torch.no_grad():
        reference = model.run_with_hooks(tokens, fwd_hooks=[("layers.0.mlp.mlp_output",
                                                              lambda t, hook: torch.zeros_like(t))])
    torch.testing.assert_close(zeroed, reference, rtol=0, atol=0)
    for names_filter in (["blocks.0.attn.hook_pattern", "ln_final.hook_scale"],
                         lambda name: name in ("blocks.0.attn.hook_pattern", "ln_final.hook_scale")):
        with torch.no_grad():
            _, small = model.run_with_cache(tokens, names_filter=names_filter)
        assert set(small.keys()) == {"layers.0.self_attn.attention_probabilities", "norm.norm_scale"}
        torch.testing.assert_close(small["pattern", 0], cache["pattern", 0], rtol=0, atol=0)
    with torch.no_grad():
        _, every = model.run_with_cache(tokens, names_filter=list(model.aliases))
    assert set(every.keys()) == set(model.aliases.values())


def test_pos_slice_slices_each_values_own_position_axis(run):
    model, tokens, _, cache = run
    with torch.no_grad():
        _, sliced = model.run_with_cache(tokens, pos_slice=[1, 3])
    for name, point in model.hook_dict.items():
        axis = point.value.seq_axis
        if name not in sliced.cache_dict or axis is None:
            continue
        expected = cache[name].index_select(axis, torch.tensor([1, 3]))
        torch.testing.assert_close(sliced[name], expected, rtol=0, atol=0, msg=name)


# ----------------------------------------------------------------------------- weight views
def test_weight_views_share_storage_and_write_through(tl_model_factory):
    model = tl_model_factory("arcee")
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    views = [(attn.W_Q, attn.q_proj.weight), (attn.W_K, attn.k_proj.weight), (attn.W_V, attn.v_proj.weight),
             (attn.W_O, attn.o_proj.weight), (mlp.W_in, mlp.up_proj.weight), (mlp.W_out, mlp.down_proj.weight),
             (model.W_U, model.lm_head.weight), (model.W_E, model.embed_tokens.weight)]
    for view, param in views:
        assert view.data_ptr() == param.data_ptr()
    d_head, g = model.cfg.d_head, model.cfg.n_heads // model.cfg.n_key_value_heads
    assert attn.W_Q.shape == (model.cfg.n_heads, model.cfg.d_model, d_head)
    assert attn.W_K.shape == (model.cfg.n_key_value_heads, model.cfg.d_model, d_head)
    assert attn.W_O.shape == (model.cfg.n_heads, d_head, model.cfg.d_model)
    with torch.no_grad():
        attn.W_Q[1, 3, 2] += 5.0
        attn.W_K[1, 4, 0] -= 2.0
        attn.W_O[2, 1, 7] += 3.0
        mlp.W_in[5, 6] += 1.0
        model.W_U[2, 9] += 4.0
    assert attn.q_proj.weight[1 * d_head + 2, 3] == attn.W_Q[1, 3, 2]
    assert attn.k_proj.weight[1 * d_head + 0, 4] == attn.W_K[1, 4, 0]
    assert attn.o_proj.weight[7, 2 * d_head + 1] == attn.W_O[2, 1, 7]
    assert mlp.up_proj.weight[6, 5] == mlp.W_in[5, 6]
    assert model.lm_head.weight[9, 2] == model.W_U[2, 9]
    torch.testing.assert_close(attn.W_K_expanded[2 * g - 1], attn.W_K[1])


def test_weight_views_compute_the_cached_values(tl_model_factory):
    model = tl_model_factory("arcee")
    tokens = tokens_for(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(cache["hook_embed"], model.W_E[tokens])
    g = model.cfg.n_heads // model.cfg.n_key_value_heads
    for layer, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        x = cache["normalized", layer, "ln1"] * block.ln1.weight
        torch.testing.assert_close(torch.einsum("bsm,hmd->bshd", x, attn.W_Q), cache["q", layer], **close)
        torch.testing.assert_close(torch.einsum("bsm,hmd->bshd", x, attn.W_K), cache["k", layer], **close)
        torch.testing.assert_close(torch.einsum("bsm,hmd->bshd", x, attn.W_V), cache["v", layer], **close)
        torch.testing.assert_close(torch.einsum("bshd,hdm->bsm", cache["z", layer], attn.W_O),
                                   cache["attn_out", layer], **close)
        y = cache["normalized", layer, "ln2"] * block.ln2.weight
        torch.testing.assert_close(y @ mlp.W_in, cache["pre", layer], **close)
        torch.testing.assert_close(cache["post", layer] @ mlp.W_out, cache["mlp_out", layer], **close)
        # Circuits: query head h reads kv head h // g.
        qk, ov = attn.QK.AB, attn.OV.AB
        for h in range(model.cfg.n_heads):
            scores = torch.einsum("bqd,bkd->bqk", cache["q", layer][:, :, h], cache["k", layer][:, :, h // g])
            torch.testing.assert_close(torch.einsum("bqm,mn,bkn->bqk", x, qk[h], x), scores, **close)
            torch.testing.assert_close(x @ ov[h], cache["v", layer][:, :, h // g] @ attn.W_O[h], **close)
        torch.testing.assert_close(model.W_Q[layer], attn.W_Q)
        torch.testing.assert_close(model.OV.AB[layer], ov)
        torch.testing.assert_close(model.QK.AB[layer], qk)
    final = cache["ln_final.hook_normalized"] * model.ln_final.weight
    torch.testing.assert_close(final @ model.W_U + model.b_U, cache["logits"], **close)


def test_alpha_er_weights_are_the_factored_projections_with_frozen_scales(tl_model_factory):
    """alpha-er's W_Q ... W_U are FactoredMatrix views of the factored projections, exact with each
    bottleneck LayerNorm's scale frozen at its cached value; W_in/W_out are per expert."""
    from transformer_lens import FactoredMatrix

    model = tl_model_factory("alpha_er")
    tokens = tokens_for(model)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert isinstance(attn.W_Q, FactoredMatrix) and isinstance(model.W_U, FactoredMatrix)
    for view, param in [(attn.W_Q.A, attn.qkv_proj.down), (attn.W_O.A, attn.o_proj.down), (mlp.W_in, mlp.up_proj.weight),
                        (mlp.W_out, mlp.down_proj.weight), (model.W_U.A, model.lm_head.down),
                        (model.W_pos, model.embed_positions.weight)]:
        assert view.data_ptr() == param.data_ptr()
    with torch.no_grad():
        attn.W_O.A[1, 2, 3] += 1.0
        model.W_U.A[4, 5] += 1.0
        mlp.W_out[1, 2, 3] += 1.0
    assert attn.o_proj.down[3, 1 * model.cfg.d_head + 2] == attn.W_O.A[1, 2, 3]
    assert model.lm_head.down[5, 4] == model.W_U.A[4, 5]
    assert mlp.down_proj.weight[1, 3, 2] == mlp.W_out[1, 2, 3]
    with torch.no_grad():
        attn.W_O.A[1, 2, 3] -= 1.0
        model.W_U.A[4, 5] -= 1.0
        mlp.W_out[1, 2, 3] -= 1.0
    width, experts = model.cfg.d_mlp // model.cfg.mlp_experts, model.cfg.mlp_experts
    for layer, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        x = cache[f"layers.{layer}.attention_norm_output"]
        s_qkv = cache[f"layers.{layer}.self_attn.qkv_proj.norm.norm_scale"][..., None]
        s_o = cache[f"layers.{layer}.self_attn.o_proj.norm.norm_scale"]
        for w, b, name in ((attn.W_Q, attn.b_Q, "q"), (attn.W_K, attn.b_K, "k"), (attn.W_V, attn.b_V, "v")):
            torch.testing.assert_close(torch.einsum("bsm,hmd->bshd", x, w.AB) / s_qkv + b, cache[name, layer], **close)
        heads = torch.einsum("bshd,hdm->bsm", cache["z", layer], attn.W_O.AB)
        torch.testing.assert_close(heads / s_o + attn.b_O, cache["attn_out", layer], **close)
        q, k = cache["q", layer] - attn.b_Q, cache["k", layer] - attn.b_K
        bilinear = torch.einsum("bqm,hmn,bkn->bhqk", x, attn.QK.AB, x)
        scale = s_qkv[..., 0, 0][:, None, :, None] * s_qkv[..., 0, 0][:, None, None, :]
        torch.testing.assert_close(bilinear / scale, torch.einsum("bqhd,bkhd->bhqk", q, k), **close)
        torch.testing.assert_close(attn.OV.AB, attn.W_V.AB @ attn.W_O.AB, **close)
        torch.testing.assert_close(model.OV.AB[layer], attn.OV.AB, **close)
        torch.testing.assert_close(model.W_Q.AB[layer], attn.W_Q.AB, **close)
        torch.testing.assert_close(model.W_in[layer], mlp.W_in)
        # The experts: token t's pre-activations are expert floor(t·G/T)'s, zero elsewhere.
        y = cache[f"layers.{layer}.mlp_norm_output"]
        every = torch.einsum("bsd,gdw->bsgw", y, mlp.W_in)
        own = torch.nn.functional.one_hot(mlp.expert_index(tokens.shape[1]), experts)[None, :, :, None]
        torch.testing.assert_close((every * own).flatten(-2), cache["pre", layer], **close)
        torch.testing.assert_close(cache["post", layer] @ mlp.W_out.flatten(0, 1), cache["mlp_out", layer], **close)
        assert mlp.W_in.shape == (experts, model.cfg.d_model, width)
    s_head = cache["lm_head.norm.norm_scale"]
    readout = (cache["final_norm_output"] @ model.W_U.A) @ model.W_U.B / s_head + model.b_U
    torch.testing.assert_close(readout, logits, **close)
    torch.testing.assert_close(cache["hook_pos_embed"][0], model.W_pos[: tokens.shape[1]], rtol=0, atol=0)
    torch.testing.assert_close(model.W_E_pos[model.cfg.d_vocab + 2], model.W_pos[2], rtol=0, atol=0)


# ----------------------------------------------------------------------- the cache's helpers
def test_decompositions_sum_to_the_stream_they_decompose(run):
    model, _, _, cache = run
    n = model.cfg.n_layers
    for layer in range(n + 1):
        target = cache["resid_post", n - 1] if layer == n else cache["resid_pre", layer]
        torch.testing.assert_close(cache.decompose_resid(layer).sum(0), target, **close)
        full, labels = cache.get_full_resid_decomposition(layer, expand_neurons=True, return_labels=True)
        assert len(labels) == full.shape[0]
        torch.testing.assert_close(full.sum(0), target, **close)
        if layer > 0:
            heads = cache.stack_head_results(layer, incl_remainder=True)
            torch.testing.assert_close(heads.sum(0), target, **close)
    for layer in range(n):
        torch.testing.assert_close(cache.decompose_resid(layer, mlp_input=True).sum(0), cache["resid_mid", layer],
                                   **close)
        torch.testing.assert_close(cache.get_full_resid_decomposition(layer, mlp_input=True).sum(0),
                                   cache["resid_mid", layer], **close)
        heads = cache.stack_head_results(layer + 1)[layer * model.cfg.n_heads:]
        torch.testing.assert_close(heads.sum(0) + model.blocks[layer].attn.out_bias(), cache["attn_out", layer],
                                   **close)
        neurons = cache.stack_neuron_results(layer + 1)[layer * model.cfg.d_mlp:]
        torch.testing.assert_close(neurons.sum(0), cache["mlp_out", layer], **close)
    accumulated = cache.accumulated_resid(incl_mid=True)
    torch.testing.assert_close(accumulated[-1], cache["resid_post", n - 1])


def test_head_results_are_computed_from_z_when_not_cached(run):
    model, tokens, _, cache = run
    model.set_use_attn_result(True)  # TransformerLens scripts call it; hook_result is there either way
    with torch.no_grad():
        _, partial = model.run_with_cache(tokens, names_filter=lambda name: "result" not in name)
    assert "blocks.0.attn.hook_result" not in partial
    torch.testing.assert_close(partial.stack_head_results(), cache.stack_head_results(), **close)
    assert "layers.0.self_attn.attention_head_results" in partial.cache_dict  # stored by its own name


def test_apply_ln_gives_each_components_share_of_the_norms_output(run):
    """Summed, the normed stack is the norm's output (less its bias): the weight is applied."""
    model, _, _, cache = run
    n = model.cfg.n_layers
    for layer in range(n + 1):
        for mlp_input in ((False, True) if layer < n else (False,)):
            if layer == n:
                norm, name = model.ln_final, "final_norm_output"
            else:
                norm = model.blocks[layer].ln2 if mlp_input else model.blocks[layer].ln1
                name = f"layers.{layer}.{'mlp_norm_output' if mlp_input else 'attention_norm_output'}"
            bias = getattr(norm, "bias", None)
            target = cache[name] - (0 if bias is None else bias)
            stack = cache.get_full_resid_decomposition(layer, mlp_input=mlp_input, apply_ln=True)
            torch.testing.assert_close(stack.sum(0), target, **close)


def test_direct_logit_attribution_sums_to_the_logit_difference(run):
    model, tokens, logits, cache = run
    assert (model.ln_final.weight - 1).abs().max() > 0.1  # the trap only shows with real norm weights
    answer, wrong = torch.tensor([3, 7]), torch.tensor([5, 1])
    truth = logits[torch.arange(2), :, answer] - logits[torch.arange(2), :, wrong]
    bias = cache.readout_bias_attrs(answer, wrong)
    for stack in (cache.get_full_resid_decomposition(expand_neurons=True), cache.decompose_resid(),
                  cache.get_full_resid_decomposition(expand_neurons=False)):
        attrs = cache.logit_attrs(stack, answer, wrong)
        torch.testing.assert_close(attrs.sum(0) + bias, truth, **close)
    # One position, and a string-free single token: the logit itself.
    stack = cache.decompose_resid(pos_slice=-1)
    attrs = cache.logit_attrs(stack, 4, pos_slice=-1)
    torch.testing.assert_close(attrs.sum(0) + cache.readout_bias_attrs(4, pos_slice=-1), logits[:, -1, 4], **close)
    # The projected fast path of get_full_resid_decomposition agrees (divided by the readout's
    # frozen scale, which logit_attrs applies itself).
    direction = model.tokens_to_residual_directions(3) - model.tokens_to_residual_directions(5)
    projected = cache.get_full_resid_decomposition(apply_ln=True, project_output_onto=direction)
    torch.testing.assert_close(projected.sum(0) / cache.readout_scale() + cache.readout_bias_attrs(3, 5),
                               logits[..., 3] - logits[..., 5], **close)


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_dla_of_the_embedded_models_sums_to_the_logit_difference_within_the_readme_bound(family):
    """docs/guide/transformer-lens.md's claim: on the embedded IOI models, in float32, a full decomposition's
    attributions plus readout_bias_attrs are the logit difference to within 1e-6 of the logits' scale
    (max |logit|). Not bit for bit: hundreds of float32 terms summed in another order than the forward adds
    them (measured: at most 3.3e-7 of the scale)."""
    from hooked_models import HookedAlphaEr, HookedArcee
    from hooked_models.embedded.task import make_ioi_prompts

    model = (HookedArcee if family == "arcee" else HookedAlphaEr).from_pretrained("embedded")
    prompts = make_ioi_prompts(64, seed=0, tokenizer=model.tokenizer)
    with torch.no_grad():
        logits, cache = model.run_with_cache(prompts.clean_tokens)
        rows = torch.arange(len(prompts))
        truth = logits[rows, :, prompts.correct] - logits[rows, :, prompts.incorrect]
        bias = cache.readout_bias_attrs(prompts.correct, prompts.incorrect)
        for stack in (cache.get_full_resid_decomposition(expand_neurons=True), cache.decompose_resid()):
            attrs = cache.logit_attrs(stack, prompts.correct, prompts.incorrect)
            gap = float((attrs.sum(0) + bias - truth).abs().max())
            assert gap <= 1e-6 * float(logits.abs().max()), gap


def test_logit_lens_and_accumulated_resid_reach_the_models_logits(run):
    model, _, logits, cache = run
    stack = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(model.unembed(stack[-1]), logits, **close)
    lens = cache.logit_lens(positions=None)
    torch.testing.assert_close(lens.values[-1], logits, **close)
    assert lens.values.shape[0] == model.cfg.n_layers + 1


# ---------------------------------------------------------------------------------- gradients
def test_run_with_cache_incl_bwd_gives_the_gradients(tl_model):
    model = tl_model
    tokens = tokens_for(model)
    loss, cache = model.run_with_cache(tokens, return_type="loss", incl_bwd=True)
    kept = {}

    def keep(tensor, hook):
        kept[hook.name] = tensor

    keys, _ = model.resolve_hook_name("blocks.0.attn.hook_k")  # before rotary, where there is one
    loss2 = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[("layers.1.layer_input", keep), (keys, keep)])
    grads = torch.autograd.grad(loss2, [kept["layers.1.layer_input"], kept[keys]])
    grads = grads[0], model.hook_dict[keys].value.to_tl(grads[1])  # [batch pos kv_head d_head]
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(cache["blocks.1.hook_resid_pre_grad"], grads[0], **close)
    torch.testing.assert_close(cache["blocks.0.attn.hook_k_grad"], grads[1], **close)
    # A backward hook added under a TransformerLens name sees that name and that layout.
    seen = {}
    model.add_hook("blocks.0.attn.hook_k", lambda grad, hook: seen.update(grad=grad, name=hook.name), dir="bwd")
    model(tokens, return_type="loss").backward()
    model.reset_hooks()
    assert seen["name"] == "blocks.0.attn.hook_k"
    torch.testing.assert_close(seen["grad"], grads[1], **close)


def test_incl_bwd_of_logits_says_to_pass_the_loss(tl_model):
    """TransformerLens backpropagates what the model returns, so incl_bwd needs a scalar: the error says
    which call works, and no hook is left behind."""
    with pytest.raises(ValueError, match=r'returned a tensor of shape \(2, 8, \d+\); pass return_type="loss".*'
                                         r'run_with_cache\(tokens, return_type="loss", incl_bwd=True\)'):
        tl_model.run_with_cache(tokens_for(tl_model), incl_bwd=True)
    assert not any(p.fwd_hooks or p.bwd_hooks for p in tl_model.standard_hook_dict.values())


def test_attribution_patching_agrees_with_patching_for_small_edits(tl_model):
    model = tl_model
    tokens = tokens_for(model, seed=1)
    metric = lambda logits: logits[:, -1, 3].sum() - logits[:, -1, 5].sum()  # noqa: E731
    grads, acts = {}, {}
    model.add_hook("blocks.1.attn.hook_z", lambda t, hook: acts.update(z=t.detach()))
    model.add_hook("blocks.1.attn.hook_z", lambda g, hook: grads.update(z=g.detach()), dir="bwd")
    base = metric(model(tokens))
    base.backward()
    model.reset_hooks()
    edit = 0.02 * torch.randn(acts["z"].shape, generator=torch.Generator().manual_seed(0))
    estimates = (grads["z"] * edit).sum((0, 1, 3))
    truths = []
    for head in range(model.cfg.n_heads):
        def patch(z, hook, head=head):
            z = z.clone()
            z[:, :, head] += edit[:, :, head]
            return z

        with torch.no_grad():
            truths.append(metric(model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", patch)])) - base)
    truths = torch.stack(truths).detach()
    assert truths.abs().max() > 1e-3
    torch.testing.assert_close(estimates, truths, rtol=0.05, atol=1e-4)


# ---------------------------------------------------------------------------- weight processing
def test_fold_ln_leaves_logits_and_attributions_unchanged(tl_model):
    model = tl_model
    tokens = tokens_for(model)
    with torch.no_grad():
        before = model(tokens)
        model.fold_ln()
        logits, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(logits, before, **close)
    for norm, _ in model.norm_readers():
        assert bool((norm.weight == 1).all())
    attrs = cache.logit_attrs(cache.get_full_resid_decomposition(), 3, 5)
    torch.testing.assert_close(attrs.sum(0) + cache.readout_bias_attrs(3, 5), logits[..., 3] - logits[..., 5],
                               **close)


def test_center_unembed_keeps_the_distribution(tl_model):
    model = tl_model
    tokens = tokens_for(model)
    with torch.no_grad():
        before = model(tokens).log_softmax(-1)
        model.center_unembed()
        after = model(tokens).log_softmax(-1)
    torch.testing.assert_close(after, before, **close)
    w_u = model.W_U if isinstance(model.W_U, torch.Tensor) else model.W_U.AB
    torch.testing.assert_close(w_u.mean(-1), torch.zeros(model.cfg.d_model), rtol=0, atol=1e-6)


def test_dla_on_a_batchless_cache_and_a_batch_slice(tl_model):
    """remove_batch_dim (head results then computed from a batchless z) and apply_slice_to_batch_dim
    keep this cache's class and its exact attributions."""
    model = tl_model
    tokens = tokens_for(model)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens[:1], remove_batch_dim=True, names_filter=lambda n: "result" not in n)
        attrs = cache.logit_attrs(cache.get_full_resid_decomposition(), 3, 5, has_batch_dim=False)
        torch.testing.assert_close(attrs.sum(0) + cache.readout_bias_attrs(3, 5), logits[0, :, 3] - logits[0, :, 5],
                                   **close)
        logits, cache = model.run_with_cache(tokens)
        one = cache.apply_slice_to_batch_dim(1)
    assert type(one) is type(cache) and not one.has_batch_dim
    attrs = one.logit_attrs(one.decompose_resid(), 3, 5, has_batch_dim=False)
    torch.testing.assert_close(attrs.sum(0) + one.readout_bias_attrs(3, 5), logits[1, :, 3] - logits[1, :, 5], **close)
