"""Transcoders: the arithmetic against explicit formulas, the activations, circuit-tracer's file layout,
and the model identity a set refuses another model by."""

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hooked_models import HookedAlphaEr, HookedArcee
from hooked_models.transcoders import (
    CrossLayerTranscoder, ModelIdentity, Transcoder, TranscoderSet, init_transcoder_, jumprelu, load_transcoders,
    step,
)


@pytest.fixture(scope="module")
def arcee():
    return HookedArcee.from_pretrained("embedded")


@pytest.fixture(scope="module")
def alpha_er():
    return HookedAlphaEr.from_pretrained("embedded")


@pytest.mark.parametrize("skip", [False, True])
def test_relu_transcoder_is_its_formula(skip, random_transcoder_):
    tc = random_transcoder_(Transcoder(8, 32, 6, layer=1, skip=skip))
    x = torch.randn(3, 5, 8)
    pre = torch.einsum("bsi,if->bsf", x, tc.W_enc) + tc.b_enc
    expected = torch.einsum("bsf,fo->bso", pre.clamp(min=0), tc.W_dec) + tc.b_dec
    if skip:
        expected = expected + torch.einsum("bsi,oi->bso", x, tc.W_skip)
    torch.testing.assert_close(tc.encode(x, apply_activation=False), pre, rtol=0, atol=1e-5)
    torch.testing.assert_close(tc(x), expected, rtol=0, atol=1e-5)
    assert (tc.encode(x) >= 0).all() and (tc.encode(x) == 0).any() and (tc.encode(x) > 0).any()
    assert (tc.input_hook, tc.output_hook) == ("layers.1.mlp_input", "layers.1.mlp.mlp_output")
    assert (tc.hook_name, tc.hook_name_out) == (tc.input_hook, tc.output_hook)


def test_topk_keeps_the_k_largest_through_relu(random_transcoder_):
    tc = random_transcoder_(Transcoder(8, 32, activation="topk", k=5))
    x = torch.randn(64, 8)
    pre, acts = tc.encode(x, apply_activation=False), tc.encode(x)
    for row_pre, row in zip(pre, acts):
        top = set(row_pre.argsort(descending=True)[:5].tolist())
        kept = {i for i in range(32) if row[i] != 0}
        assert kept == {i for i in top if row_pre[i] > 0}
        assert torch.equal(row[list(kept)], row_pre[list(kept)])
    assert ((acts != 0).sum(-1) <= 5).all() and ((acts != 0).sum(-1) == 5).any()


def test_jumprelu_forward_and_straight_through_gradients(random_transcoder_):
    tc = random_transcoder_(Transcoder(8, 32, activation="jumprelu"))
    x = torch.randn(256, 8)
    pre = tc.encode(x, apply_activation=False).detach()
    acts = tc.encode(x)
    assert torch.equal(acts, torch.where(pre > tc.threshold, pre, torch.zeros(())))
    assert ((pre > 0) & (pre <= tc.threshold)).any()  # the threshold zeroes positive pre-activations

    # The threshold's gradient: -(θ/ε)·Σ rect((pre-θ)/ε)·g (Rajamanoharan et al. eq. 11), here g = 1,
    # with a bandwidth wide enough that entries fall inside the kernel.
    eps = 0.5
    theta = tc.threshold.detach().clone().requires_grad_(True)
    pre_req = pre.clone().requires_grad_(True)
    jumprelu(pre_req, theta, eps).sum().backward()
    inside = ((pre - theta.detach()) / eps).abs() < 0.5
    expected = -(theta.detach() / eps) * inside.sum(0)
    assert inside.any()
    torch.testing.assert_close(theta.grad, expected)
    assert torch.equal(pre_req.grad, (pre > theta.detach()).float())  # the input's true gradient

    theta.grad = None
    pre_req.grad = None
    step(pre_req, theta, eps).sum().backward()
    torch.testing.assert_close(theta.grad, -(1 / eps) * inside.sum(0).float())
    assert torch.equal(pre_req.grad, torch.zeros_like(pre))


def test_cross_layer_transcoder_is_its_formula(random_transcoder_):
    clt = random_transcoder_(CrossLayerTranscoder(3, 8, 16, activation="relu", skip=True))
    xs = [torch.randn(2, 4, 8) for _ in range(3)]
    acts = [torch.relu(x @ clt.W_enc[l] + clt.b_enc[l]) for l, x in enumerate(xs)]
    for l in range(3):
        torch.testing.assert_close(clt.encode(l, xs[l]), acts[l])
    outs = clt(xs)
    for target in range(3):
        expected = clt.b_dec[target] + xs[target] @ clt.W_skip[target].T
        for source in range(target + 1):
            expected = expected + torch.einsum("bsf,fo->bso", acts[source], clt.W_dec[source][:, target - source])
        torch.testing.assert_close(outs[target], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(clt.decode_to(target, acts, xs[target]), expected, rtol=0, atol=1e-5)
    # A later layer's features do not reach an earlier layer; a missing source contributes nothing.
    only_first = clt.decode_to(2, {0: acts[0]}, xs[2])
    torch.testing.assert_close(only_first, clt.b_dec[2] + xs[2] @ clt.W_skip[2].T + acts[0] @ clt.W_dec[0][:, 2])
    with pytest.raises(ValueError, match="layer 2's features write layers 2"):
        clt.decoder(2, 1)


def test_transcoder_set_interface(random_transcoder_):
    tcs = TranscoderSet([random_transcoder_(Transcoder(8, 16, layer=l), l) for l in range(2)])
    x = torch.randn(3, 8)
    assert (tcs.n_layers, tcs.d_transcoder, len(tcs)) == (2, 16, 2)
    assert tcs.input_hook(1) == "layers.1.mlp_input" and tcs.output_hook(0) == "layers.0.mlp.mlp_output"
    torch.testing.assert_close(tcs.decode_to(1, {1: tcs.encode(1, x)}), tcs[1](x))
    assert tcs.decoder(1, 1) is tcs[1].W_dec
    with pytest.raises(ValueError, match="writes only layer 0's"):
        tcs.decoder(0, 1)
    with pytest.raises(ValueError, match="layer=2 is not a layer"):
        tcs.encode(2, x)
    with pytest.raises(ValueError, match="per layer 0 ... n-1"):
        TranscoderSet([Transcoder(8, 16, layer=1)])
    with pytest.raises(ValueError, match="d_transcoder=32"):
        TranscoderSet([Transcoder(8, 16, layer=0), Transcoder(8, 32, layer=1)])


@pytest.mark.parametrize("activation,k,skip", [("relu", None, False), ("topk", 4, True), ("jumprelu", None, True)])
def test_transcoder_set_round_trips_circuit_tracers_layout(tmp_path, arcee, activation, k, skip,
                                                          random_transcoder_):
    tcs = TranscoderSet([random_transcoder_(Transcoder(64, 32, layer=l, activation=activation, k=k, skip=skip), l)
                         for l in range(2)], model=arcee)
    tcs.save(tmp_path)
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["model_kind"] == "transcoder_set"
    assert (config["feature_input_hook"], config["feature_output_hook"]) == ("mlp_input", "mlp.mlp_output")
    assert config["transcoders"] == ["layer_0.safetensors", "layer_1.safetensors"]
    assert (config["model_family"], config["hidden_size"], config["num_layers"]) == ("arcee", 64, 2)
    state = load_file(str(tmp_path / "layer_1.safetensors"))
    assert state["W_enc"].shape == (32, 64) and state["W_dec"].shape == (32, 64)  # circuit-tracer's layout
    assert ("activation_function.threshold" in state) == (activation == "jumprelu")
    assert ("W_skip" in state) == skip
    loaded = load_transcoders(tmp_path, model=arcee)
    assert isinstance(loaded, TranscoderSet) and loaded.activation == activation and loaded[0].k == k
    for a, b in zip(tcs.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(5, 64)
    assert torch.equal(loaded[1](x), tcs[1](x))


def test_cross_layer_transcoder_round_trips(tmp_path, alpha_er, random_transcoder_):
    clt = random_transcoder_(CrossLayerTranscoder(2, 64, 16, activation="jumprelu", skip=True, model=alpha_er))
    clt.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "W_dec_0.safetensors", "W_dec_1.safetensors", "W_enc_0.safetensors", "W_enc_1.safetensors", "config.yaml"]
    assert load_file(str(tmp_path / "W_dec_0.safetensors"))["W_dec_0"].shape == (16, 2, 64)
    assert load_file(str(tmp_path / "W_enc_1.safetensors"))["W_enc_1"].shape == (16, 64)
    loaded = load_transcoders(tmp_path, model=alpha_er)
    assert isinstance(loaded, CrossLayerTranscoder) and loaded.identity == ModelIdentity("alpha_er", 64, 2)
    for (name, a), b in zip(clt.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_transcoders_for_another_model_are_refused(tmp_path, arcee, alpha_er):
    TranscoderSet([Transcoder(64, 16, layer=l) for l in range(2)], model=arcee).save(tmp_path)
    with pytest.raises(ValueError, match="trained for the arcee model .* this model has family='alpha_er'"):
        TranscoderSet.load(tmp_path, model=alpha_er)
    with pytest.raises(ValueError, match="3 transcoders for a model of 2 layers"):
        TranscoderSet([Transcoder(64, 16, layer=l) for l in range(3)], model=arcee)
    with pytest.raises(ValueError, match="d_in=32"):
        TranscoderSet([Transcoder(32, 16, layer=l) for l in range(2)], model=arcee)
    with pytest.raises(ValueError, match="model_kind='transcoder_set', expected 'cross_layer_transcoder'"):
        CrossLayerTranscoder.load(tmp_path)


@pytest.mark.parametrize("kwargs,message", [
    (dict(activation="gelu"), "activation='gelu' must be one of relu, topk, jumprelu"),
    (dict(activation="topk"), "k=None: a TopK transcoder needs an integer k in \\[1, d_transcoder=16\\]"),
    (dict(activation="topk", k=17), "k=17"),
    (dict(activation="relu", k=3), "k=3 is for activation='topk'"),
    (dict(layer=-1), "layer=-1"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Transcoder(8, 16, **kwargs)


def test_init_transcoder_gives_unit_decoder_rows():
    tc = Transcoder(8, 32, activation="jumprelu")
    init_transcoder_(tc, seed=3, threshold=0.1)
    torch.testing.assert_close(tc.W_dec.norm(dim=-1), torch.ones(32))
    assert torch.equal(tc.W_enc, tc.W_dec.T) and torch.equal(tc.threshold, torch.full((32,), 0.1))


# ------------------------------------------------------------------------------ the replacement model
def random_set(model, randomize_, activation="relu", k=None, skip=True, d_transcoder=48):
    d = model.cfg.hidden_size
    return TranscoderSet([randomize_(Transcoder(d, d_transcoder, layer=l, activation=activation, k=k, skip=skip), l)
                          for l in range(model.cfg.num_layers)], model=model)


@pytest.fixture
def tl_tokens(tl_model):
    seq = tl_model.cfg.block_size if hasattr(tl_model.cfg, "block_size") else 8
    return torch.randint(0, tl_model.cfg.d_vocab, (2, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("activation,k", [("relu", None), ("topk", 6), ("jumprelu", None)])
def test_replacement_with_error_terms_is_the_model_bit_for_bit(tl_model, tl_tokens, activation, k,
                                                               random_transcoder_):
    model, tokens = tl_model, tl_tokens
    tcs = random_set(model, random_transcoder_, activation, k)
    with torch.no_grad():
        base, base_cache = model.run_with_cache(tokens)
        logits, cache = model.run_with_cache_with_saes(tokens, saes=tcs, use_error_term=True)
    assert torch.equal(logits, base)
    for key, value in base_cache.cache_dict.items():
        assert torch.equal(cache.cache_dict[key], value), key
    for tc in tcs:
        x, y = base_cache[tc.input_hook], base_cache[tc.output_hook]
        acts = tc.encode(x)
        out = tc.output_hook
        assert torch.equal(cache[f"{out}.hook_sae_input"], x)
        assert torch.equal(cache[f"{out}.hook_sae_acts_post"], acts)
        assert torch.equal(cache[f"{out}.hook_sae_recons"], tc(x))
        assert torch.equal(cache[f"{out}.hook_sae_error"], y - tc(x))
        assert bool((acts > 0).any()) and bool((acts == 0).any())
    assert model.acts_to_saes == {}  # the context removed them


def test_replacement_without_error_terms_is_the_transcoders_forward(tl_model, tl_tokens, random_transcoder_):
    """Each MLP output replaced by tc(its MLP input), against plain hooks written here; an edit of the
    MLP input by a hook reaches the transcoder."""
    model, tokens = tl_model, tl_tokens
    tcs = random_set(model, random_transcoder_)
    shift = lambda x, hook: x + 0.25  # noqa: E731
    seen = {}

    def keep(x, hook):
        seen[hook.name] = x

    def replace(layer):
        return lambda y, hook: tcs[layer](seen[tcs[layer].input_hook]).to(y.dtype)

    with torch.no_grad():
        spliced = model.run_with_hooks_with_saes(tokens, saes=tcs, use_error_term=False,
                                                 fwd_hooks=[(tcs[0].input_hook, shift)])
        expected = model.run_with_hooks(tokens, fwd_hooks=[(tcs[0].input_hook, shift)] + [
            hook for tc in tcs for hook in ((tc.input_hook, keep), (tc.output_hook, replace(tc.layer)))])
    assert torch.equal(spliced, expected)
    assert not torch.equal(spliced, model(tokens))


def test_replacement_gradients_run_through_the_transcoders_only(tl_model, tl_tokens, random_transcoder_):
    """With error terms the MLPs are constants: no gradient reaches their weights; the features get
    (d metric / d mlp_output) W_dec.T."""
    model, tokens = tl_model, tl_tokens
    tcs = random_set(model, random_transcoder_)
    grads = {}

    def keep(grad, hook):
        grads[hook.name] = grad

    with model.saes(saes=tcs, use_error_term=True):
        for tc in tcs:
            model.add_hook(f"{tc.output_hook}.hook_sae_acts_post", keep, dir="bwd")
            model.add_hook(f"{tc.output_hook}.hook_sae_output", keep, dir="bwd")
        model(tokens)[:, -1, 3].sum().backward()
        model.reset_hooks()
    up = model.layers[0].mlp.up_proj.weight.grad
    assert up is None or not up.any()
    assert model.layers[0].self_attn.parameters().__next__().grad.abs().sum() > 0  # what feeds the transcoders
    for tc in tcs:
        name = tc.output_hook
        torch.testing.assert_close(grads[f"{name}.hook_sae_acts_post"],
                                   grads[f"{name}.hook_sae_output"] @ tc.W_dec.detach().T, rtol=1e-5, atol=1e-6)
    model.zero_grad()


def test_replacement_reset_restores_the_model(tl_model, tl_tokens, random_transcoder_):
    model, tokens = tl_model, tl_tokens
    before, printed = model(tokens), repr(model)
    model.add_sae(random_set(model, random_transcoder_), use_error_term=False)
    assert sorted(model.acts_to_saes) == [f"layers.{l}.mlp.mlp_output" for l in range(model.cfg.num_layers)]
    assert not torch.equal(model(tokens), before)
    model.reset_saes()
    assert torch.equal(model(tokens), before) and repr(model) == printed
    assert all(not p.readers for p in model.standard_hook_dict.values() if hasattr(p, "readers"))


def test_bad_transcoder_splices_are_clear_errors(tl_model, tl_tokens):
    model = tl_model
    d = model.cfg.hidden_size
    with pytest.raises(ValueError, match=rf"width {d + 1} cannot read 'layers\.0\.mlp_input'"):
        model.add_sae(Transcoder(d + 1, 8, d, layer=0))
    with pytest.raises(ValueError, match=rf"width {d + 2} cannot read 'layers\.0\.mlp\.mlp_output'"):
        model.add_sae(Transcoder(d, 8, d + 2, layer=0))
    with pytest.raises(ValueError, match="spliced on the value it writes, not on 'layers.0.mlp_input'"):
        model.add_sae(Transcoder(d, 8, layer=0), "layers.0.mlp_input")
    assert model.acts_to_saes == {}
