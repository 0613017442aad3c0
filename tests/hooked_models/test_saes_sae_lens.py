"""SAELens, unchanged, as a client of both families (the SAE environment: pip install -e ".[sae]"):
its training runner at a hook named either way, its activation cache runner and training from that
cache, its evals, and its SAEs spliced with `add_sae`. Every number SAELens reports is checked against
the model's own computation here (run_with_cache, run_with_saes, the forward's loss)."""

import copy
import os

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens", reason="SAELens is not installed (pip install -e '.[sae]')")
os.environ.setdefault("WANDB_MODE", "disabled")
# SAELens warns, rightly, that these datasets are tiny (several epochs) and that its overrides are not
# reproducible from its configuration alone.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:sae_lens")

from datasets import Dataset  # noqa: E402  (SAELens brings datasets)
from sae_lens import (  # noqa: E402
    CacheActivationsRunnerConfig,
    LanguageModelSAERunnerConfig,
    LanguageModelSAETrainingRunner,
    LoggingConfig,
    StandardSAE,
    StandardSAEConfig,
    StandardTrainingSAE,
    StandardTrainingSAEConfig,
)
from sae_lens.evals import EvalConfig, run_evals  # noqa: E402
from sae_lens.saes.sae import SAEMetadata  # noqa: E402
from sae_lens.training.activation_scaler import ActivationScaler  # noqa: E402
from sae_lens.training.activations_store import ActivationsStore  # noqa: E402

from hooked_models import HookedAlphaEr, HookedArcee  # noqa: E402
from hooked_models.embedded.task import make_ioi_prompts  # noqa: E402
from hooked_models.saes import cache_activations_runner  # noqa: E402

CONTEXT = 16  # a multiple of alpha-er's expert windows (tiny: 32/4, embedded: 16/4)


@pytest.fixture(params=["arcee", "alpha_er", "embedded_arcee", "embedded_alpha_er"])
def model_and_tokens(request, tl_model_factory):
    """A tiny random model or an embedded trained one, and 32 rows of CONTEXT tokens for it."""
    if request.param.startswith("embedded"):
        model = (HookedArcee if request.param == "embedded_arcee" else HookedAlphaEr).from_pretrained("embedded")
        tokens = make_ioi_prompts(32, seed=0).clean_tokens
    else:
        model = tl_model_factory(request.param)
        tokens = torch.randint(0, model.cfg.d_vocab, (32, CONTEXT), generator=torch.Generator().manual_seed(0))
    assert tokens.shape[1] == CONTEXT
    return model, tokens


def activations(model, tokens, hook):
    """The model's value at `hook` as an SAE reads it: [batch pos d_in], TransformerLens's layout."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=[hook])
    return cache[hook].flatten(2)


def explained_variance(sae, x):
    x = x.flatten(0, 1)
    with torch.no_grad():
        residual = (x - sae.decode(sae.encode(x))).pow(2).sum(-1).mean()
    return float(1 - residual / (x - x.mean(0)).pow(2).sum(-1).mean())


def runner_cfg(hook, d_in, **changes):
    fields = dict(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=2 * d_in, l1_coefficient=0.1), model_name="hooked",
        hook_name=hook,
        dataset_path="", is_dataset_tokenized=True, streaming=False, context_size=CONTEXT, prepend_bos=False,
        training_tokens=4096, train_batch_size_tokens=64, store_batch_size_prompts=8, n_batches_in_buffer=4,
        lr=1e-2, device="cpu", logger=LoggingConfig(log_to_wandb=False), checkpoint_path=None, output_path=None,
        n_checkpoints=0, verbose=False, seed=0,
    )
    return LanguageModelSAERunnerConfig(**{**fields, **changes})


def train(model, tokens, hook, d_in=None, **changes):
    """SAELens's training runner on the model; (trained SAE, the same SAE untrained)."""
    cfg = runner_cfg(hook, d_in or activations(model, tokens[:1], hook).shape[-1], **changes)
    torch.manual_seed(0)
    sae = StandardTrainingSAE(cfg.sae)
    untrained = copy.deepcopy(sae)
    dataset = Dataset.from_dict({"tokens": tokens.tolist()})
    trained = LanguageModelSAETrainingRunner(cfg, override_model=model, override_dataset=dataset,
                                             override_sae=sae).run()
    return trained, untrained


# Each family at a standard name and at a TransformerLens one (a head value, flattened as SAELens does).
@pytest.mark.parametrize("hook", ["layers.1.layer_output", "blocks.0.attn.hook_z"])
def test_training_runner_trains_at_a_hook_named_either_way(model_and_tokens, hook):
    model, tokens = model_and_tokens
    trained, untrained = train(model, tokens, hook)
    assert trained.cfg.metadata.hook_name == hook
    # What SAELens trains on is the model's value (its store runs stop_at_layer, prepend_bos=False).
    store = ActivationsStore.from_config(model, runner_cfg(hook, trained.cfg.d_in),
                                         override_dataset=Dataset.from_dict({"tokens": tokens.tolist()}))
    x = activations(model, tokens, hook)
    torch.testing.assert_close(store.get_activations(tokens), x, rtol=0, atol=0)
    before, after = explained_variance(untrained, x), explained_variance(trained, x)
    assert after > 0.8 and after > before + 0.5, (before, after)


def test_cache_runner_writes_the_models_activations_and_training_reads_them(model_and_tokens, tmp_path):
    model, tokens = model_and_tokens
    hook, d_in = "blocks.1.hook_resid_post", model.cfg.d_model
    rows = tokens.shape[0]
    cfg = CacheActivationsRunnerConfig(
        dataset_path="", model_name="hooked", hook_name=hook, d_in=d_in, context_size=CONTEXT,
        model_batch_size=8, training_tokens=rows * CONTEXT, new_cached_activations_path=str(tmp_path / "acts"),
        buffer_size_gb=rows * CONTEXT * d_in * 4 / 4 / 1e9, shuffle=False, prepend_bos=False, device="cpu")
    cached = cache_activations_runner(model, cfg, Dataset.from_dict({"tokens": tokens.tolist()})).run()
    cached.set_format("torch")
    assert len(cached) == rows
    token_ids, acts = cached[:]["token_ids"].long(), cached[:][hook]
    assert torch.equal(token_ids, tokens)
    torch.testing.assert_close(acts, activations(model, token_ids, hook), rtol=0, atol=0)

    # Training from the cache: the model never runs (a permanent hook on its input would count it).
    calls = []
    model.add_hook("input_ids", lambda ids, hook: calls.append(1), is_permanent=True)
    try:
        trained, untrained = train(model, tokens, hook, d_in, use_cached_activations=True,
                                   cached_activations_path=str(tmp_path / "acts"), store_batch_size_prompts=4)
    finally:
        model.reset_hooks(including_permanent=True)
    assert calls == []
    x = activations(model, tokens, hook)
    before, after = explained_variance(untrained, x), explained_variance(trained, x)
    assert after > 0.8 and after > before + 0.5, (before, after)


@pytest.mark.parametrize("hook", ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z"])
def test_evals_report_the_models_own_losses_and_reconstruction(model_and_tokens, hook):
    """run_evals on 4 rows (every batch is those rows): CE loss without the SAE is the forward's
    loss, with it the loss of `run_with_saes` (the package's splice, not SAELens's hook), with the
    value zeroed that of a zeroing hook; MSE, L0 and explained variance come from our cache."""
    model, tokens = model_and_tokens
    tokens = tokens[:4]
    trained, _ = train(model, tokens, hook, training_tokens=1024)
    sae = StandardSAE(StandardSAEConfig.from_dict({**trained.cfg.to_dict(), "architecture": "standard"}))
    sae.load_state_dict(trained.state_dict())
    store = ActivationsStore.from_config(model, runner_cfg(hook, sae.cfg.d_in),
                                         override_dataset=Dataset.from_dict({"tokens": tokens.tolist()}))
    config = EvalConfig(batch_size_prompts=4, n_eval_reconstruction_batches=1, compute_ce_loss=True,
                        compute_kl=True, n_eval_sparsity_variance_batches=1, compute_variance_metrics=True,
                        compute_sparsity_metrics=True)
    metrics, _ = run_evals(sae, store, model, ActivationScaler(), config, exclude_special_tokens=False)

    with torch.no_grad():
        logits, loss = model(tokens, return_type="both", loss_per_token=True)
        spliced_logits, spliced_loss = model.run_with_saes(tokens, saes=[sae], return_type="both",
                                                           loss_per_token=True)
        zeroed = model.run_with_hooks(tokens, return_type="loss", loss_per_token=True,
                                      fwd_hooks=[(hook, lambda value, hook: torch.zeros_like(value))])
        _, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
    performance = metrics["model_performance_preservation"]
    assert performance["ce_loss_without_sae"] == pytest.approx(float(loss.mean()), rel=1e-6)
    assert performance["ce_loss_with_sae"] == pytest.approx(float(spliced_loss.mean()), rel=1e-5)
    assert performance["ce_loss_with_ablation"] == pytest.approx(float(zeroed.mean()), rel=1e-6)
    kl = (logits.log_softmax(-1).exp() * (logits.log_softmax(-1) - spliced_logits.log_softmax(-1))).sum(-1)
    assert metrics["model_behavior_preservation"]["kl_div_with_sae"] == pytest.approx(float(kl.mean()),
                                                                                      rel=1e-4, abs=1e-6)
    x = cache[f"{hook}.hook_sae_input"].flatten(0, 1)
    x_hat = cache[f"{hook}.hook_sae_recons"].flatten(0, 1)
    acts = cache[f"{hook}.hook_sae_acts_post"].flatten(0, 1)
    mse = (x - x_hat).pow(2).sum(-1).mean()
    assert metrics["reconstruction_quality"]["mse"] == pytest.approx(float(mse), rel=1e-5)
    variance = (x - x.mean(0)).pow(2).sum(-1).mean()
    assert metrics["reconstruction_quality"]["explained_variance"] == pytest.approx(float(1 - mse / variance),
                                                                                    rel=1e-4)
    assert metrics["sparsity"]["l0"] == pytest.approx(float((acts != 0).sum(-1).float().mean()), rel=1e-6)


# ------------------------------------------------------------------------ SAELens's SAEs spliced
def standard_sae(hook, d_in, reshape="none", seed=0):
    torch.manual_seed(seed)
    sae = StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=2 * d_in, reshape_activations=reshape,
                                        metadata=SAEMetadata(hook_name=hook)))
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.2)
        sae.b_dec.normal_(0, 0.2)
    return sae


@pytest.mark.parametrize("hook", ["blocks.1.hook_resid_post", "layers.0.mlp.mlp_output", "blocks.1.attn.hook_z",
                                  "blocks.0.attn.hook_v"])
def test_sae_lens_saes_splice_by_their_own_hook_name(model_and_tokens, hook):
    model, tokens = model_and_tokens
    tokens = tokens[:2]
    sae = standard_sae(hook, activations(model, tokens[:1], hook).shape[-1],
                       reshape="hook_z" if hook.endswith("hook_z") else "none")
    with torch.no_grad():
        base, base_cache = model.run_with_cache(tokens)
        spliced = model.run_with_saes(tokens, saes=[sae])
        # SAE.forward, by a plain hook on the name it was trained at (heads flattened as it reads them).
        expected = model.run_with_hooks(tokens, fwd_hooks=[(hook, lambda v, hook: sae(
            v if sae.hook_z_reshaping_mode else v.flatten(2)).reshape(v.shape))])
        logits, cache = model.run_with_cache_with_saes(tokens, saes=[sae], use_error_term=True)
    torch.testing.assert_close(spliced, expected, rtol=0, atol=0)
    assert not torch.equal(spliced, base)
    assert torch.equal(logits, base)
    value = base_cache[hook]  # TransformerLens's layout; a hook_z SAE flattens the heads itself
    x = value.flatten(2)
    canonical, _ = model.resolve_hook_name(hook)
    for name in (hook, canonical):
        torch.testing.assert_close(cache[f"{name}.hook_sae_acts_pre"],
                                   (x - sae.b_dec) @ sae.W_enc + sae.b_enc, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache[f"{name}.hook_sae_acts_post"],
                                   sae.encode(value if sae.hook_z_reshaping_mode else x), rtol=0, atol=0)
    assert model.acts_to_saes == {} and sae.hook_sae_acts_post.name == "hook_sae_acts_post"


def test_editing_a_sae_lens_feature_moves_the_output_by_its_reconstruction(model_and_tokens):
    """With the error term, an edit to a StandardSAE's features (its own hook_sae_acts_post, fired inside its
    encode) moves the value by the edit's effect on the reconstruction, computed here from the SAE's weights.
    The clean reconstruction must run with the SAE's hooks off, or the edit cancels itself out."""
    model, tokens = model_and_tokens
    tokens, hook = tokens[:2], "blocks.1.hook_resid_pre"
    sae = standard_sae(hook, activations(model, tokens[:1], hook).shape[-1])

    def encode(x):  # StandardSAE's arithmetic, written out
        return torch.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc)

    def decode(acts):
        return acts @ sae.W_dec + sae.b_dec

    feature = int(encode(activations(model, tokens, hook)).sum((0, 1)).argmax())

    def edit(acts, hook):
        acts = acts.clone()
        acts[..., feature] *= 3.0
        return acts

    def expected_edit(value, hook):
        acts = encode(value)
        return value - (decode(acts) - decode(edit(acts, hook)))

    with torch.no_grad():
        base = model(tokens)
        edited = model.run_with_hooks_with_saes(tokens, saes=[sae], use_error_term=True,
                                                fwd_hooks=[(f"{hook}.hook_sae_acts_post", edit)])
        expected = model.run_with_hooks(tokens, fwd_hooks=[(hook, expected_edit)])
    assert float((expected - base).abs().max()) > 0.1  # the edit matters
    torch.testing.assert_close(edited, expected, rtol=1e-5, atol=1e-5)
    assert model.acts_to_saes == {}


def test_hooked_sae_transformers_own_path_is_not_silently_broken(model_and_tokens):
    """HookedSAETransformer.add_sae sets its wrapper where the hook's name points (set_deep_attr):
    at a TransformerLens name here that is refused, instead of a module nothing calls."""
    from sae_lens.analysis.hooked_sae_transformer import _SAEWrapper, set_deep_attr

    model, _ = model_and_tokens
    sae = standard_sae("blocks.0.hook_resid_post", model.cfg.d_model)
    with pytest.raises(AttributeError, match="TransformerLens name.*model.add_sae"):
        set_deep_attr(model, "blocks.0.hook_resid_post", _SAEWrapper(sae))
    model.add_sae(sae)  # the package's add_sae takes the same SAE at the same name
    assert model.acts_to_saes == {"layers.0.layer_output": sae}
    model.reset_saes()
