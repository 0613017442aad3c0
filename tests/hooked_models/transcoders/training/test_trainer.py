"""The trainer in one process: every kind learns the embedded models' MLPs, from a harvest and streamed from
the model, resumes bit for bit, and runs where the caller turned gradients off."""

import json

import pytest
import torch

from hooked_models import HookedArcee
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.transcoders import (
    CrossLayerTranscoder, HarvestReader, ModelIdentity, TrainingConfig, TranscoderSet, evaluate, train_transcoders,
    transcoder_fidelity,
)


def mlp_names(model):
    return [name for l in range(model.cfg.num_layers)
            for name in (f"layers.{l}.mlp_input", f"layers.{l}.mlp.mlp_output")]


@pytest.fixture(scope="module", params=["arcee", "alpha_er"])
def embedded_harvest(request, tmp_path_factory, arcee, alpha_er):
    from hooked_models import corpus

    model = arcee if request.param == "arcee" else alpha_er
    out = tmp_path_factory.mktemp(f"harvest-{request.param}") / "acts"
    tokens = make_ioi_prompts(256, 41).clean_tokens
    corpus.harvest(model, tokens, mlp_names(model), out, progress=False)
    return model, out, tokens


def batch_fvu(tcs, x, y):
    """Each layer's Σ|y - ŷ|² / Σ|y - ȳ|² on one batch, written out here (sparsify's definition)."""
    out = []
    with torch.no_grad():
        acts = [tcs.encode(l, x[l]) for l in range(tcs.n_layers)]
        for l in range(tcs.n_layers):
            y_hat = tcs.decode_to(l, acts, x[l])
            out.append(float(((y[l] - y_hat) ** 2).sum() / ((y[l] - y[l].mean(0)) ** 2).sum()))
    return out


@pytest.mark.parametrize("config", [
    dict(activation="relu", sparsity=1e-3),
    dict(activation="topk", k=8, skip=True),
    dict(activation="batchtopk", k=8),
    dict(activation="jumprelu", sparsity=1e-3, pre_act_loss=1e-4),
    dict(activation="jumprelu", sparsity=1e-3, penalty="l0"),
    dict(activation="relu", cross_layer=True),
    dict(activation="jumprelu", cross_layer=True, skip=True),
], ids=["relu", "topk-skip", "batchtopk", "jumprelu-tanh", "jumprelu-l0", "cross-layer-relu",
        "cross-layer-jumprelu-skip"])
def test_every_kind_learns_the_mlps(embedded_harvest, config):
    """After 40 steps every kind leaves under half of each layer's variance unexplained on a batch it did
    not train on (predicting the mean leaves all of it)."""
    model, harvest, _ = embedded_harvest
    config = TrainingConfig(d_transcoder=64, steps=40, batch_tokens=256, lr=3e-3, **config)
    tcs = train_transcoders(harvest, config=config, progress=False)
    assert isinstance(tcs, CrossLayerTranscoder if config.cross_layer else TranscoderSet)
    assert tcs.identity == ModelIdentity.of(model)
    x, y = HarvestReader(harvest).batch(1000, 256, 0)
    assert max(batch_fvu(tcs, x, y)) < 0.5, batch_fvu(tcs, x, y)


def test_batchtopk_saves_jumprelus_with_its_learned_threshold(embedded_harvest):
    _, harvest, _ = embedded_harvest
    config = TrainingConfig(d_transcoder=64, steps=30, batch_tokens=256, lr=3e-3, activation="batchtopk", k=8)
    tcs = train_transcoders(harvest, config=config, progress=False)
    assert tcs.activation == "jumprelu"
    for tc in tcs:  # one threshold for every feature, positive: the running mean of the smallest kept value
        assert float(tc.threshold.detach().min()) == float(tc.threshold.detach().max()) > 0
    x, _ = HarvestReader(harvest).batch(1000, 256, 0)
    l0 = [float((tcs.encode(l, x[l]) > 0).sum(-1).float().mean()) for l in range(tcs.n_layers)]
    assert all(2 < v < 32 for v in l0), l0  # near k = 8 on average, as trained


def test_training_explains_the_mlps(embedded_harvest):
    """TopK transcoders after a short run (200 steps of 512 tokens) explain the MLP outputs on held-out
    prompts: on the embedded Arcee above 0.95 of each layer's variance and 0.9 of the next-token loss; on
    alpha-er, whose first layer's positional experts are harder, above 0.5."""
    model, harvest, _ = embedded_harvest
    config = TrainingConfig(d_transcoder=128, activation="topk", k=16, steps=200, batch_tokens=512, lr=3e-3)
    tcs = train_transcoders(harvest, config=config, progress=False)
    fidelity = transcoder_fidelity(model, tcs, make_ioi_prompts(64, 4242).clean_tokens)
    explained, recovered = (0.95, 0.9) if isinstance(model, HookedArcee) else (0.5, 0.5)
    assert min(fidelity["variance_explained"]) > explained, fidelity
    assert fidelity["loss_recovered"] > recovered, fidelity


def test_training_resumes_from_its_checkpoint_bit_for_bit(embedded_harvest, tmp_path, monkeypatch):
    from hooked_models.transcoders.training import sources

    _, harvest, _ = embedded_harvest
    config = TrainingConfig(d_transcoder=32, steps=20, batch_tokens=128, checkpoint_every=5, activation="jumprelu")
    whole = train_transcoders(harvest, config=config, progress=False)
    batch = sources.HarvestReader.batch

    def interrupted(self, step_index, *args):
        if step_index == 13:
            raise KeyboardInterrupt
        return batch(self, step_index, *args)

    monkeypatch.setattr(sources.HarvestReader, "batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_transcoders(harvest, config=config, checkpoint=tmp_path / "ckpt", progress=False)
    assert [p.name for p in (tmp_path / "ckpt").glob("step-*")] == ["step-00000010"]
    monkeypatch.setattr(sources.HarvestReader, "batch", batch)
    resumed = train_transcoders(harvest, config=config, checkpoint=tmp_path / "ckpt", progress=False)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="checkpoint .* is of another training run: its config"):
        train_transcoders(harvest, config=config.replace(lr=1e-3), checkpoint=tmp_path / "ckpt", progress=False)


def test_streaming_in_the_datas_order_equals_the_harvest_of_the_same_rows(arcee, tmp_path):
    """With the buffer off, a streamed batch is the dataset's next rows: training on the model equals
    training on a harvest read in that order (the harvest path, `harvest_dir=`, reads random rows)."""
    tokens = make_ioi_prompts(64, 41).clean_tokens
    config = TrainingConfig(d_transcoder=32, steps=4, batch_tokens=256, buffer_tokens=0, activation="topk", k=4)
    streamed = train_transcoders(arcee, dataset=tokens, config=config, progress=False)
    from hooked_models.transcoders.training.distributed import Layout, process_group
    from hooked_models.transcoders.training.objective import batch_loss
    from hooked_models.transcoders.training.state import Shard
    from hooked_models.transcoders.training.trainer import first_batch_init, lr_factor

    # The same four steps by hand, batches cut from one run_with_cache of the rows in order.
    _, cache = arcee.run_with_cache(tokens, names_filter=mlp_names(arcee))
    xs = torch.stack([cache[f"layers.{l}.mlp_input"].flatten(0, 1) for l in range(2)])
    ys = torch.stack([cache[f"layers.{l}.mlp.mlp_output"].flatten(0, 1) for l in range(2)])
    with process_group(), torch.enable_grad():
        layout = Layout("data", 32)
        shard = Shard(ModelIdentity.of(arcee), config, layout)
        optimizer = torch.optim.Adam(shard.trained_parameters(), lr=config.lr)
        for step in range(4):
            x, y = xs[:, step * 256:(step + 1) * 256], ys[:, step * 256:(step + 1) * 256]
            if step == 0:
                first_batch_init(shard, x, y, layout, 256)
            optimizer.param_groups[0]["lr"] = config.lr * lr_factor(step, config)
            optimizer.zero_grad()
            batch_loss(shard, x, y, config, layout, 256).loss.backward()
            optimizer.step()
    by_hand = shard.gathered()
    for (name, a), b in zip(streamed.state_dict().items(), by_hand.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_bfloat16_model_streams_in_its_dtype_and_trains_in_float32(tmp_path):
    """The buffer holds the model's bfloat16 activations (half the bytes); the transcoders train in float32."""
    model = HookedArcee.from_pretrained("embedded", dtype=torch.bfloat16)
    tokens = make_ioi_prompts(64, 41).clean_tokens
    from hooked_models.transcoders import StreamingSource

    stream = StreamingSource(model, tokens, [0, 1], batch_tokens=128, buffer_tokens=512, forward_batch=8, streams=1,
                             share=(0, 1), seed=0)
    x, y = stream.batch()
    assert stream.mine[0].buffer.dtype == torch.bfloat16 and x.dtype == y.dtype == torch.float32
    config = TrainingConfig(d_transcoder=16, steps=5, batch_tokens=128, buffer_tokens=512, activation="topk", k=4)
    tcs = train_transcoders(model, dataset=tokens, config=config, progress=False)
    assert tcs.dtype == torch.float32 and all(bool(p.isfinite().all()) for p in tcs.parameters())


def test_training_works_with_gradients_turned_off_and_leaves_them_off(arcee):
    tokens = make_ioi_prompts(32, 41).clean_tokens
    config = TrainingConfig(d_transcoder=16, steps=3, batch_tokens=64, buffer_tokens=256, activation="topk", k=4)
    torch.set_grad_enabled(False)  # as TransformerLens's tutorials begin
    try:
        tcs = train_transcoders(arcee, dataset=tokens, config=config, progress=False)
        assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)
    assert isinstance(tcs, TranscoderSet)


def test_training_from_a_model_with_harvest_dir_reads_back_the_harvest(embedded_harvest, tmp_path):
    model, harvest, tokens = embedded_harvest
    config = TrainingConfig(d_transcoder=32, steps=5, batch_tokens=128)
    from_disk = train_transcoders(harvest, config=config, progress=False)
    from_model = train_transcoders(model, dataset=tokens, config=config, progress=False, harvest_dir=tmp_path / "h")
    for a, b in zip(from_disk.state_dict().values(), from_model.state_dict().values()):
        assert torch.equal(a, b)
    assert from_model.identity == ModelIdentity.of(model)


def test_a_harvest_without_the_mlp_values_is_refused(tmp_path, arcee):
    from hooked_models import corpus

    tokens = make_ioi_prompts(4, 0).clean_tokens
    corpus.harvest(arcee, tokens, ["layers.0.mlp_input"], tmp_path / "acts", progress=False)
    with pytest.raises(ValueError, match="lacks layers.0.mlp.mlp_output, layers.1.mlp_input"):
        train_transcoders(tmp_path / "acts")
    with pytest.raises(FileNotFoundError, match="not a corpus.harvest output"):
        train_transcoders(tmp_path)


def test_a_run_writes_its_transcoders_report_and_curves(arcee, tmp_path):
    from hooked_models.transcoders import load_transcoders

    tokens = make_ioi_prompts(64, 41).clean_tokens
    config = TrainingConfig(d_transcoder=32, steps=12, batch_tokens=128, buffer_tokens=512, activation="topk", k=4,
                            log_every=4)
    held_out = make_ioi_prompts(16, 4242).clean_tokens
    tcs = train_transcoders(arcee, dataset=tokens, config=config, out=tmp_path / "tc", progress=False,
                            eval_dataset=held_out)
    loaded = load_transcoders(tmp_path / "tc", model=arcee)
    for (name, a), b in zip(tcs.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    report = json.loads((tmp_path / "tc" / "training.json").read_text())
    assert report["config"]["k"] == 4 and report["run"]["processes"] == 1 and report["run"]["tokens"] == 12 * 128
    assert [c["tokens"] for c in report["curves"]] == [512, 1024, 1536]
    last = report["curves"][-1]
    assert len(last["fvu"]) == len(last["l0"]) == len(last["dead_pct"]) == 2
    assert all(v == 4.0 for v in last["l0"]) and last["fvu"][0] < report["curves"][0]["fvu"][0]
    assert (tmp_path / "tc" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["evaluation"] == evaluate(arcee, tcs, held_out, progress=False)


def test_some_layers_train_alone(arcee, tmp_path):
    """layers=(1,): layer 1's transcoder only, the model run no further than layer 1, saved as its file."""
    tokens = make_ioi_prompts(64, 41).clean_tokens
    config = TrainingConfig(d_transcoder=16, steps=3, batch_tokens=128, buffer_tokens=512, layers=(1,))
    trained = train_transcoders(arcee, dataset=tokens, config=config, out=tmp_path / "tc", progress=False)
    assert list(trained) == [1] and trained[1].layer == 1
    assert sorted(p.name for p in (tmp_path / "tc").glob("layer_*")) == ["layer_1.safetensors"]


def test_a_cancelled_run_stops_at_a_step_and_its_rerun_resumes(arcee, tmp_path):
    from hooked_models.progress import Cancelled

    tokens = make_ioi_prompts(64, 41).clean_tokens
    config = TrainingConfig(d_transcoder=16, steps=10, batch_tokens=128, buffer_tokens=512, activation="topk", k=4,
                            checkpoint_every=4)
    whole = train_transcoders(arcee, dataset=tokens, config=config, progress=False)
    seen = []

    def stop_at_six(step):
        seen.append(step.done)
        if step.done == 6:
            raise Cancelled("enough")

    with pytest.raises(Cancelled, match="training stopped after step 6 of 10"):
        train_transcoders(arcee, dataset=tokens, config=config, checkpoint=tmp_path / "ckpt", progress=stop_at_six)
    assert seen == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text())["step"] == 6  # saved on cancelling
    resumed = train_transcoders(arcee, dataset=tokens, config=config, checkpoint=tmp_path / "ckpt", progress=False)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_first_batch_spreads_every_feature_alike_and_centres_the_biases():
    """init_spread="equal": on the first batch, every feature's centred pre-activations have the standard
    deviation the mean feature's had (the columns' directions kept), the encoder bias centres them and the
    decoder bias is the mean output; "drawn" scales nothing. Inputs of very unequal variance per direction, so
    that the drawn spreads differ several-fold."""
    from hooked_models.transcoders.training.distributed import Layout, process_group
    from hooked_models.transcoders.training.state import Shard
    from hooked_models.transcoders.training.trainer import first_batch_init

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(1, 512, 8, generator=g) * torch.logspace(-2, 0.5, 8)) + 0.3
    y = torch.randn(1, 512, 8, generator=g) - 0.4
    with process_group():
        for spread in ("equal", "drawn"):
            config = TrainingConfig(d_transcoder=16, activation="topk", k=2, init_spread=spread)
            shard = Shard(ModelIdentity("arcee", 8, 1), config, Layout("data", 16))
            drawn = shard.enc(0).detach().clone()
            before = ((x[0] - x[0].mean(0)).double() @ drawn.double()).std(0, correction=0)
            assert float(before.max() / before.min()) > 3
            first_batch_init(shard, x, y, shard.layout, 512)
            enc = shard.enc(0).detach()
            pre = x[0].double() @ enc.double() + shard.b_enc(0).detach().double()
            torch.testing.assert_close(pre.mean(0), torch.zeros(16, dtype=torch.float64), rtol=0, atol=1e-6)
            torch.testing.assert_close(shard.b_dec(0).detach(), y[0].mean(0), rtol=1e-6, atol=1e-7)
            if spread == "drawn":
                assert torch.equal(enc, drawn)
                continue
            torch.testing.assert_close(pre.std(0, correction=0), before.mean().expand(16), rtol=1e-5, atol=0)
            torch.testing.assert_close(enc / enc.norm(dim=0), drawn / drawn.norm(dim=0), rtol=1e-5, atol=1e-7)
