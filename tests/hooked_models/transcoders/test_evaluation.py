"""transcoders.evaluate against oracles written here, sharing none of its code: the transcoders' formulas
written out, the MLPs replaced by hooks of this file in one full run over the whole dataset, FVU as
EleutherAI's sparsify defines it over the concatenated tokens, KL summed by hand in float64, while
evaluate streams the same windows in uneven batches. Both families; per-layer sets with skip connections
and cross-layer transcoders; TopK and JumpReLU; every parameter random, each encoder drawn apart from its
decoder."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from hooked_models import HookedAlphaEr, HookedArcee
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.transcoders import (
    CrossLayerTranscoder,
    LazyTranscoderSet,
    Transcoder,
    TranscoderSet,
    evaluate,
    load_transcoders,
)

FAMILIES = {"arcee": HookedArcee, "alpha_er": HookedAlphaEr}
D_TRANSCODER, K, DEAD = 48, 3, 4  # features 0 ... DEAD-1 of each layer never fire (see random_transcoders)
WINDOWS, BATCH = 13, 4  # batches of 4, 4, 4 and 1 window


@pytest.fixture(scope="module")
def models():
    return {family: cls.from_pretrained("embedded") for family, cls in FAMILIES.items()}


@pytest.fixture(scope="module")
def tokens():
    return make_ioi_prompts(WINDOWS, seed=11).clean_tokens  # [13 16]


def random_transcoders(model, kind: str, activation: str, randomize, seed: int = 0):
    """Transcoders with every parameter drawn apart (an encoder is not its decoder's transpose, as
    `init_transcoder_` would make it; biases and skip connections non-zero), decoders scaled to the
    MLPs' size, and the first DEAD features of each layer silenced by their bias, so that both live and
    dead features are counted."""
    d, n = model.cfg.hidden_size, model.cfg.num_layers
    k = K if activation == "topk" else None
    if kind == "per_layer":
        tcs = TranscoderSet([Transcoder(d, D_TRANSCODER, layer=l, activation=activation, k=k, skip=True)
                             for l in range(n)], model=model)
    else:
        tcs = CrossLayerTranscoder(n, d, D_TRANSCODER, activation=activation, k=k, skip=True, model=model)
    randomize(tcs, seed)
    with torch.no_grad():
        for name, p in tcs.named_parameters():
            if "dec" in name or "skip" in name:
                p.mul_(0.1)
            if "b_enc" in name:
                p[..., :DEAD] = -1e4
    return tcs


# ------------------------------------------------------------------------------------------- oracle
def features(tcs, l: int, x: torch.Tensor) -> torch.Tensor:
    """Layer l's features of its MLP input x, from the formulas."""
    per_layer = isinstance(tcs, TranscoderSet)
    w_enc, b_enc = (tcs[l].W_enc, tcs[l].b_enc) if per_layer else (tcs.W_enc[l], tcs.b_enc[l])
    pre = x @ w_enc + b_enc
    if tcs.activation == "topk":  # the k largest, through ReLU
        top = pre.topk(tcs.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.clamp(min=0))
    threshold = tcs[l].threshold if per_layer else tcs.threshold[l]
    return pre * (pre > threshold)


def output(tcs, l: int, acts: dict, x: torch.Tensor) -> torch.Tensor:
    """Layer l's MLP output from the features (a cross-layer transcoder's: of layers 0 ... l), with the skip."""
    if isinstance(tcs, TranscoderSet):
        return acts[l] @ tcs[l].W_dec + tcs[l].b_dec + torch.einsum("...i,oi->...o", x, tcs[l].W_skip)
    written = sum(acts[s] @ tcs.W_dec[s][:, l - s] for s in range(l + 1))
    return written + tcs.b_dec[l] + torch.einsum("...i,oi->...o", x, tcs.W_skip[l])


def run(model, tcs, tokens, splice=(), zero=()):
    """Logits with the MLPs of the layers in `splice` replaced by the transcoders (features of this run's
    own MLP inputs) and those in `zero` zeroed; one run over every window."""
    acts, inputs = {}, {}

    def read(x, hook, l):
        acts[l], inputs[l] = features(tcs, l, x), x

    def write(y, hook, l):
        return output(tcs, l, acts, inputs[l])

    hooks = [(f"layers.{l}.mlp_input", partial(read, l=l)) for l in range(model.cfg.num_layers)]
    hooks += [(f"layers.{l}.mlp.mlp_output", partial(write, l=l)) for l in splice]
    hooks += [(f"layers.{l}.mlp.mlp_output", lambda y, hook: torch.zeros_like(y)) for l in zero]
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)


def cross_entropy(logits, tokens) -> float:
    return float(F.cross_entropy(logits[:, :-1].double().flatten(0, 1), tokens[:, 1:].flatten()))


def recovered(zero: float, spliced: float, loss: float) -> float:
    return (zero - spliced) / (zero - loss)


CASES = [("arcee", "per_layer", "topk"), ("alpha_er", "per_layer", "jumprelu"), ("arcee", "clt", "jumprelu"),
         ("alpha_er", "clt", "topk")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def case(request, models, tokens, random_transcoder_):
    family, kind, activation = request.param
    model = models[family]
    tcs = random_transcoders(model, kind, activation, random_transcoder_)
    report = evaluate(model, tcs, tokens, batch_size=BATCH, progress=False)
    return model, tcs, report


def test_it_counts_what_it_evaluated(case, tokens):
    _, _, report = case
    assert (report["tokens"], report["windows"], report["context_size"], report["batches"]) == (13 * 16, 13, 16, 4)


def test_fvu_is_sparsifys_over_every_token_while_streamed(case, tokens):
    model, tcs, report = case
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    acts = {}
    for l in range(model.cfg.num_layers):
        x, y = cache[f"layers.{l}.mlp_input"], cache[f"layers.{l}.mlp.mlp_output"]
        acts[l] = features(tcs, l, x)
        y_hat = output(tcs, l, acts, x).detach()
        y, y_hat = y.flatten(0, 1).double(), y_hat.flatten(0, 1).double()
        fvu = float((y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
        assert fvu > 0.05  # far from perfect
        assert report["fvu"][l] == pytest.approx(fvu, rel=1e-5)
        assert report["variance_explained"][l] == pytest.approx(1 - fvu, rel=1e-5)


def test_l0_and_dead_features_are_a_direct_count(case, tokens):
    model, tcs, report = case
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for l in range(model.cfg.num_layers):
        on = (features(tcs, l, cache[f"layers.{l}.mlp_input"]) != 0).flatten(0, 1)  # [token feature]
        dead = 100 * float((~on.any(0)).sum()) / D_TRANSCODER
        assert 100 * DEAD / D_TRANSCODER <= dead < 100
        assert report["dead_percent"][l] == pytest.approx(dead, abs=1e-12)
        assert report["l0"][l] == pytest.approx(float(on.sum(1).double().mean()), rel=1e-12)


def test_the_replacement_models_loss_and_kl_are_the_hand_spliced_models(case, tokens):
    model, tcs, report = case
    n = model.cfg.num_layers
    with torch.no_grad():
        logits = model(tokens)
    replaced, zeroed = run(model, tcs, tokens, splice=range(n)), run(model, tcs, tokens, zero=range(n))
    loss, spliced, zero = (cross_entropy(x, tokens) for x in (logits, replaced, zeroed))
    assert spliced - loss > 0.01  # the replacement differs from the model
    assert report["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["loss_spliced"] == pytest.approx(spliced, rel=1e-5)
    assert report["loss_zero_ablated"] == pytest.approx(zero, rel=1e-5)
    assert report["loss_gap"] == pytest.approx(spliced - loss, rel=1e-4)
    assert report["loss_recovered"] == pytest.approx(recovered(zero, spliced, loss), rel=1e-4)
    log_p, log_q = logits.double().log_softmax(-1), replaced.double().log_softmax(-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())  # KL(model ‖ replacement), every position
    assert kl > 0.01
    assert report["kl_divergence"] == pytest.approx(kl, rel=1e-4)


def test_each_layers_loss_recovered_is_a_hand_splice_of_that_layer_alone(case, tokens):
    model, tcs, report = case
    with torch.no_grad():
        loss = cross_entropy(model(tokens), tokens)
    for l in range(model.cfg.num_layers):
        spliced = cross_entropy(run(model, tcs, tokens, splice=[l]), tokens)
        zero = cross_entropy(run(model, tcs, tokens, zero=[l]), tokens)
        assert report["layer_loss_spliced"][l] == pytest.approx(spliced, rel=1e-5)
        assert report["layer_loss_zero_ablated"][l] == pytest.approx(zero, rel=1e-5)
        assert report["layer_loss_recovered"][l] == pytest.approx(recovered(zero, spliced, loss), rel=1e-4)


# ------------------------------------------------------------------------------------------- inputs
def test_a_lazy_set_and_a_saved_dataset_give_the_resident_sets_numbers(models, tokens, tmp_path, random_transcoder_):
    datasets = pytest.importorskip("datasets")
    model = models["arcee"]
    tcs = random_transcoders(model, "per_layer", "jumprelu", random_transcoder_)
    tcs.save(tmp_path / "tc")
    datasets.Dataset.from_dict({"tokens": tokens.tolist()}).save_to_disk(str(tmp_path / "windows"))
    lazy = load_transcoders(tmp_path / "tc", model=model, lazy=True)
    assert isinstance(lazy, LazyTranscoderSet)
    resident = evaluate(model, tcs, tokens, batch_size=BATCH)
    assert evaluate(model, lazy, str(tmp_path / "windows"), batch_size=BATCH) == resident


def test_cancelled_after_a_batch_it_leaves_no_hook(models, tokens, progress_checks):
    model = models["alpha_er"]
    tcs = load_transcoders("embedded", model=model)
    probe = progress_checks.check_cancelled(
        model, tokens, lambda progress: evaluate(model, tcs, tokens, batch_size=BATCH, progress=progress), cancel_at=1)
    assert probe.steps[0].done == BATCH * 16
    complete = progress_checks.Probe()
    evaluate(model, tcs, tokens, batch_size=BATCH, progress=complete)
    complete.check_complete("tok")
    assert [s.done for s in complete.steps] == [64, 128, 192, 208]


@pytest.mark.parametrize("change,message", [
    (dict(family="alpha_er"), r"trained for the arcee model .*; this model has family='alpha_er' \(expected 'arcee'\)"),
    (dict(tokens=torch.zeros((0, 16), dtype=torch.long)), r"the dataset has no rows"),
    (dict(batch_size=0), r"batch_size=0 must be a positive integer"),
    (dict(batch_size=True), r"batch_size=True must be a positive integer"),
    (dict(transcoders="one"), r"transcoders is a Transcoder; evaluate takes a TranscoderSet"),
    (dict(context_size=8), r"context_size=8, but the token windows are 16 tokens long"),
    (dict(tokens=torch.full((2, 16), 1000)), r"token id of the dataset is outside the model's vocabulary \[0, 127\)"),
    (dict(tokens=torch.ones((2, 1), dtype=torch.long)), r"context_size=1: a window needs 2 tokens or more"),
], ids=["other_model", "empty", "batch_size_0", "batch_size_bool", "one_transcoder", "context_size", "token_id",
        "one_token"])
def test_bad_input_is_one_line_naming_the_value(models, tokens, change, message):
    model = models[change.get("family", "arcee")]
    tcs = load_transcoders("embedded", model=models["arcee"])
    if change.get("transcoders") == "one":
        tcs = tcs[0]
    with pytest.raises(ValueError, match=message) as error:
        evaluate(model, tcs, change.get("tokens", tokens), batch_size=change.get("batch_size", BATCH),
                 context_size=change.get("context_size"))
    assert "\n" not in str(error.value)
