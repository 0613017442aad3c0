"""Corpus-scale runs (hooked_models/corpus/): a harvest's columns are the model's cached values bit for
bit, only the layers needed run, text is packed as SAELens packs it, a killed harvest finishes on rerun
with the bytes of an uninterrupted one, a harvest of another job is refused, and patching over a dataset
is the mean over its pairs. The Ray engine's tests are in test_corpus_ray.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

from hooked_models import HookedAlphaEr, HookedArcee, corpus, patching  # noqa: E402
from hooked_models.__main__ import build_parser, main  # noqa: E402
from hooked_models.embedded.task import make_ioi_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Unit roundoff of float32: a mean of n terms summed in two orders differs by at most 2·n·u·max|term|.
U32 = 2.0**-24


def tokens_for(model, rows: int, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))


def reference_columns(model, tokens, names, batch_size):
    """The model's cached values in the harvest's layout, computed independently: run_with_cache over
    the same batches, each value with its position axis second and the rest flattened."""
    parts = {name: [] for name in names}
    for start in range(0, len(tokens), batch_size):
        _, cache = model.run_with_cache(tokens[start:start + batch_size], names_filter=names)
        for name in names:
            value = model.standard_hook_dict[name].value
            dims = list(value.dims)
            position = next(i for i, d in enumerate(dims) if d in ("seq", "query"))
            order = [0, position] + [i for i in range(1, len(dims)) if i != position]
            tensor = cache[name].permute(order)
            parts[name].append(tensor.reshape(tensor.shape[0], tensor.shape[1], -1))
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


def load(out):
    """The harvest's columns as tensors [rows ...]."""
    return datasets.load_from_disk(str(out)).with_format("torch")[:]


def shards_done(out: Path) -> int:
    """How many shards the manifest records (it is replaced whole, never seen half-written)."""
    runs = json.loads((out / "manifest.json").read_text())["shards"]
    return sum(run["shards"][1] - run["shards"][0] for run in runs)


def output_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != ".lock"}


# ------------------------------------------------------------------------------------------ harvest
def test_harvest_columns_are_the_models_values(tl_model, tmp_path):
    names = ["layers.0.layer_output", "blocks.1.attn.hook_z", "layers.1.mlp.mlp_neurons", "logits"]
    standard = ["layers.0.layer_output", "layers.1.self_attn.attention_head_outputs", "layers.1.mlp.mlp_neurons",
                "logits"]
    tokens = tokens_for(tl_model, 24)
    # 24 rows in shards of 10 (10, 10, 4) and batches of 5: uneven at both levels.
    summary = corpus.harvest(tl_model, tokens, names, tmp_path / "out", batch_size=5, shard_size=10)
    data = load(tmp_path / "out")
    features = datasets.load_from_disk(str(tmp_path / "out")).features
    expected = reference_columns(tl_model, tokens, standard, 5)
    assert list(features) == [*standard, "token_ids"]
    for name in standard:
        assert torch.equal(data[name], expected[name]), name
        assert features[name].shape == tuple(expected[name].shape[1:]) and features[name].dtype == "float32"
    assert torch.equal(data["token_ids"], tokens.int())
    assert features["token_ids"].feature.dtype == "int32" and features["token_ids"].length == 16
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["names"] == standard and manifest["complete"] and manifest["layers_run"] is None
    assert manifest["shards"] == [{"shards": [0, 3], "rows": [0, 24]}]
    assert manifest["shard_files"] == "data-{shard:05d}.arrow"
    assert manifest["model"] == corpus.model_identity(tl_model)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".lock", "data-00000.arrow", "data-00001.arrow", "data-00002.arrow", "dataset_info.json", "manifest.json",
        "state.json"]  # the staged windows and temporary files are gone
    assert (summary.rows, summary.shards, summary.shards_run, summary.tokens) == (24, 3, 3, 24 * 16)


@pytest.mark.parametrize("names, layers_run, ran", [
    (["layers.0.self_attn.attention_output"], 1, [0]),
    (["blocks.1.hook_resid_pre"], 2, [0, 1]),  # a layer's own hook point fires when the layer runs
    (["token_embeddings"], 0, []),
    (["final_norm_output"], None, [0, 1]),
])
def test_only_the_layers_needed_run(tl_model, tmp_path, names, layers_run, ran):
    calls = []
    handles = [layer.register_forward_hook(lambda module, args, output, k=k: calls.append(k))
               for k, layer in enumerate(tl_model.layers)]
    try:
        summary = corpus.harvest(tl_model, tokens_for(tl_model, 4), names, tmp_path / "out", batch_size=4)
    finally:
        for handle in handles:
            handle.remove()
    assert summary.layers_run == layers_run
    assert sorted(set(calls)) == ran


def test_pack_windows():
    # Worked by hand: BOS opens each window, BOS separates documents inside one, the partial tail is dropped,
    # and a document that starts with BOS gets no second one.
    documents = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [1, 20, 21], [30]]
    assert list(corpus.pack(documents, 4, bos=1)) == [[1, 5, 6, 7], [1, 8, 9, 1], [1, 10, 11, 12],
                                                                [1, 13, 1, 20], [1, 21, 1, 30]]
    assert list(corpus.pack([[5, 6, 7], [8, 9, 10, 11, 12]], 3, bos=None)) == [[5, 6, 7], [8, 9, 10]]


def test_token_files_are_read_as_the_corpus(tmp_path):
    """Token ids [n seq] in a .npy, .pt or .safetensors file are the windows themselves; of a file of several
    tensors, the one `column` names, else the one named as a token column is."""
    from safetensors.torch import save_file

    from hooked_models.corpus.data import read_corpus

    tokens = torch.randint(0, 100, (5, 4), generator=torch.Generator().manual_seed(0))
    np.save(tmp_path / "t.npy", tokens.numpy())
    torch.save(tokens, tmp_path / "t.pt")
    save_file({"input_ids": tokens, "mask": torch.ones_like(tokens)}, str(tmp_path / "t.safetensors"))
    save_file({"a": tokens, "b": tokens.clone()}, str(tmp_path / "two.safetensors"))
    for name in ("t.npy", "t.pt", "t.safetensors"):
        read = read_corpus(str(tmp_path / name), None)
        assert read.kind == "tokens" and np.array_equal(np.concatenate(list(read.batches())), tokens.numpy())
    assert np.concatenate(list(read_corpus(tmp_path / "t.safetensors", "mask").batches())).tolist() == [[1] * 4] * 5
    with pytest.raises(ValueError, match="two.safetensors has no column named tokens or input_ids"):
        read_corpus(tmp_path / "two.safetensors", None)
    with pytest.raises(FileNotFoundError, match="no.npy"):
        read_corpus(tmp_path / "no.npy", None)
    save_file({"x": torch.zeros(3, 4, dtype=torch.bfloat16)}, str(tmp_path / "floats.safetensors"))
    with pytest.raises(ValueError, match=r"floats.safetensors \(x\) must be an integer array \[n seq\], got shape"):
        read_corpus(tmp_path / "floats.safetensors", None)


def test_pack_matches_saelens():
    batching = pytest.importorskip("sae_lens.tokenization_and_batching")
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(2, 50, (int(n),), generator=generator)
                 for n in torch.randint(1, 40, (60,), generator=generator)]
    documents[3][0] = documents[17][0] = 1  # documents that start with BOS
    for context_size in (7, 16, 33):
        ours = list(corpus.pack([d.tolist() for d in documents], context_size, bos=1))
        theirs = [w.tolist() for w in batching.concat_and_batch_sequences(
            iter(documents), context_size, begin_batch_token_id=1, sequence_separator_token_id=1)]
        assert ours == theirs


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_harvest_packs_text_with_the_models_tokenizer(family, tmp_path):
    model = corpus.load_model("embedded", family=family)
    texts = make_ioi_prompts(40, 0, tokenizer=model.tokenizer).clean_text
    datasets.Dataset.from_dict({"text": texts, "id": list(range(40))}).save_to_disk(str(tmp_path / "text"))
    corpus.harvest("embedded", str(tmp_path / "text"), ["layers.1.layer_output"], tmp_path / "out",
                   context_size=16, batch_size=8, family=family)
    documents = model.tokenizer(texts, add_special_tokens=False)["input_ids"]
    windows = torch.tensor(list(corpus.pack(documents, 16, model.tokenizer.bos_token_id)))
    data = load(tmp_path / "out")
    assert torch.equal(data["token_ids"].long(), windows)
    assert torch.equal(data["layers.1.layer_output"],
                       reference_columns(model, windows, ["layers.1.layer_output"], 8)["layers.1.layer_output"])


def test_a_streaming_dataset_gives_the_same_harvest(tmp_path):
    model = HookedArcee.from_pretrained("embedded")
    rows = {"input_ids": tokens_for(model, 20).tolist()}
    for name, dataset in (("map", datasets.Dataset.from_dict(rows)),
                          ("stream", datasets.Dataset.from_dict(rows).to_iterable_dataset())):
        corpus.harvest(model, dataset, ["layers.1.self_attn.attention_keys"], tmp_path / name, shard_size=8)
    assert output_files(tmp_path / "stream") == output_files(tmp_path / "map")


@pytest.mark.parametrize("context_size, message", [(10, "multiple of mlp_experts=4"), (20, "longer than block_size")])
def test_alpha_er_windows_obey_its_length_rule(tmp_path, context_size, message):
    texts = {"text": make_ioi_prompts(8, 0).clean_text}
    with pytest.raises(ValueError, match=f"context_size={context_size}: .*{message}"):
        corpus.harvest("embedded", datasets.Dataset.from_dict(texts), ["layers.0.layer_output"], tmp_path / "out",
                       context_size=context_size, family="alpha_er")


def test_bfloat16_is_stored_as_float32(tmp_path):
    model = corpus.load_model("embedded", dtype="bfloat16")
    tokens = tokens_for(model, 6)
    corpus.harvest("embedded", tokens, ["layers.0.mlp.mlp_output"], tmp_path / "out", dtype=torch.bfloat16)
    data = load(tmp_path / "out")
    expected = reference_columns(model, tokens, ["layers.0.mlp.mlp_output"], 32)["layers.0.mlp.mlp_output"]
    assert datasets.load_from_disk(str(tmp_path / "out")).features["layers.0.mlp.mlp_output"].dtype == "float32"
    assert expected.dtype == torch.bfloat16 and torch.equal(data["layers.0.mlp.mlp_output"], expected.float())


def test_saelens_trains_from_a_harvest(tmp_path):
    """SAELens's training runner reads the harvest as its activation cache (hook_name = the column) and the
    SAE it trains reconstructs the harvested activations far better than at its start."""
    sae_lens = pytest.importorskip("sae_lens")
    model = HookedArcee.from_pretrained("embedded")
    tokens = make_ioi_prompts(256, 0, tokenizer=model.tokenizer).clean_tokens
    corpus.harvest(model, tokens, ["blocks.0.hook_resid_post"], tmp_path / "acts", batch_size=64, shard_size=64)
    name = "layers.0.layer_output"
    cfg = sae_lens.LanguageModelSAERunnerConfig(
        sae=sae_lens.StandardTrainingSAEConfig(d_in=64, d_sae=128), model_name="embedded", hook_name=name,
        context_size=16, use_cached_activations=True, cached_activations_path=str(tmp_path / "acts"),
        training_tokens=4096, train_batch_size_tokens=64, store_batch_size_prompts=16, n_batches_in_buffer=8,
        device="cpu", logger=sae_lens.LoggingConfig(log_to_wandb=False), n_checkpoints=0,
        checkpoint_path=str(tmp_path / "checkpoints"), output_path=None, seed=0)
    runner = sae_lens.LanguageModelSAETrainingRunner(
        cfg, override_model=model, override_dataset=datasets.Dataset.from_dict({"tokens": tokens.tolist()}))
    activations, token_ids = runner.activations_store.get_raw_llm_batch()
    runner.activations_store.current_row_idx = 0
    expected = reference_columns(model, tokens[:16], [name], 16)[name]
    assert torch.equal(activations, expected.reshape(-1, 64)) and torch.equal(token_ids, tokens[:16].flatten())
    harvested = load(tmp_path / "acts")[name].reshape(-1, 64)
    initial = {k: v.clone() for k, v in runner.sae.state_dict().items()}

    def error(sae) -> float:
        with torch.no_grad():
            return float(((sae.decode(sae.encode(harvested)) - harvested) ** 2).mean())

    trained = runner.run()
    untrained = type(trained)(trained.cfg)
    untrained.load_state_dict(initial)
    assert error(trained) < 0.5 * error(untrained)


# ------------------------------------------------------------------------------------------- resume
def test_a_killed_harvest_finishes_on_rerun(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 127, (1024, 16))
    np.save(tmp_path / "tokens.npy", tokens)
    names = ["layers.0.layer_output", "blocks.1.hook_mlp_out"]
    options = dict(batch_size=2, shard_size=2)  # 512 shards: the kill lands mid-run even on a loaded machine
    corpus.harvest("embedded", tokens, names, tmp_path / "whole", **options)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "hooked_models", "harvest", "--model", "embedded", "--names", *names,
               "--dataset", str(tmp_path / "tokens.npy"), "--out", str(out), "--batch-size", "2",
               "--shard-size", "2", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # the arithmetic of this process's 1 thread
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "manifest.json").exists() or not shards_done(out):
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.005)  # until the first shard is recorded (the manifest is replaced whole, never half-written)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done = shards_done(out)
    assert not json.loads((out / "manifest.json").read_text())["complete"] and 0 < done < 512  # killed mid-run
    assert not (out / "state.json").exists()
    summary = corpus.harvest("embedded", tokens, names, out, **options)
    assert summary.shards_run == 512 - done
    assert output_files(out) == output_files(tmp_path / "whole")


def test_a_rerun_clears_what_a_killed_harvest_left_half_written(tmp_path):
    """A kill between writing a temporary and renaming it into place leaves the temporary; the rerun
    deletes it, so the output is the uninterrupted run's, file for file. (The kill test above lands
    there only by chance: CI once found a stray manifest temporary.)"""
    tokens = np.random.default_rng(1).integers(0, 127, (16, 16))
    names = ["layers.0.layer_output"]
    corpus.harvest("embedded", tokens, names, tmp_path / "whole", batch_size=2, shard_size=4)
    out = tmp_path / "killed"
    out.mkdir()
    (out / ".manifest.json.0123abcd").write_text("")  # killed before the first manifest was renamed in
    corpus.harvest("embedded", tokens, names, out, batch_size=2, shard_size=4)  # an empty directory, still
    for leftover in (".manifest.json.4567ef", "windows.int32.partial", ".state.json.partial"):
        (out / leftover).write_bytes(b"\0")
    (out / ".tmp").mkdir()
    (out / ".tmp" / "data-00001.arrow.89ab").write_bytes(b"\0")
    corpus.harvest("embedded", tokens, names, out, batch_size=2, shard_size=4)
    assert output_files(out) == output_files(tmp_path / "whole")


@pytest.mark.parametrize("change, message", [
    (dict(names=["layers.1.layer_output"]), "names"),
    (dict(model=lambda: HookedArcee.from_pretrained("embedded").to(torch.float64), dtype="float64"), "dtype"),
    (dict(model=lambda: corpus.load_model("embedded", family="alpha_er")), "model: its family and config and weights"),
    (dict(context_size=8), "context_size"),
    (dict(batch_size=4), "batch_size"),
    (dict(shard_size=16), "shard_size"),
    (dict(reverse=True), "another corpus"),
])
def test_resume_refuses_another_job(tmp_path, change, message):
    job = dict(model=lambda: HookedArcee.from_pretrained("embedded"), names=["layers.0.layer_output"],
               context_size=16, batch_size=8, shard_size=8, reverse=False, dtype=None)

    def run(model, names, reverse, **options):
        texts = make_ioi_prompts(16, 0).clean_text
        texts = datasets.Dataset.from_dict({"text": texts[::-1] if reverse else texts})
        return corpus.harvest(model(), texts, names, tmp_path / "out", **options)

    run(**job)
    before = output_files(tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        run(**{**job, **change})
    assert output_files(tmp_path / "out") == before  # nothing touched


def test_resume_false_and_foreign_directories_are_refused(tmp_path):
    model = HookedArcee.from_pretrained("embedded")
    tokens = tokens_for(model, 4)
    corpus.harvest(model, tokens, ["layers.0.layer_output"], tmp_path / "out")
    with pytest.raises(ValueError, match="not empty; pass resume=True"):
        corpus.harvest(model, tokens, ["layers.0.layer_output"], tmp_path / "out", resume=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no harvest"):
        corpus.harvest(model, tokens, ["layers.0.layer_output"], tmp_path / "other")


def test_harvest_errors_are_clear(tmp_path):
    model = HookedArcee.from_pretrained("embedded")
    tokens = tokens_for(model, 4)
    names = ["layers.0.layer_output"]
    cases = [
        (lambda: corpus.harvest(model, tokens, ["next_token_probs"], tmp_path / "a"), "has no position axis"),
        (lambda: corpus.harvest(model, tokens, [], tmp_path / "a"), "names is empty"),
        (lambda: corpus.harvest(model, tokens, names, tmp_path / "a", shard_size=0), "shard_size=0 must be"),
        (lambda: corpus.harvest(model, tokens, names, tmp_path / "a", batch_size=0), "batch_size=0 must be"),
        (lambda: corpus.harvest(model, tokens, names, tmp_path / "a", engine="spark"), "engine='spark'"),
        (lambda: corpus.harvest(model, tokens, names, tmp_path / "a", num_workers=2), "needs engine='ray'"),
        (lambda: corpus.harvest(model, tokens, names, tmp_path / "a", engine="ray"), "pass the checkpoint path"),
        (lambda: corpus.harvest(model, tokens + 200, names, tmp_path / "a"), r"token id 2\d\d is outside"),
        (lambda: corpus.harvest(model, tokens, names, tmp_path / "a", context_size=8), "windows are 16 tokens"),
        (lambda: corpus.harvest(model, tokens.float(), names, tmp_path / "a"), "integer array"),
        (lambda: corpus.harvest(model, datasets.Dataset.from_dict({"tokens": [[1, 2], [1, 2, 3]]}), names,
                                tmp_path / "a"), "differ in length"),
        (lambda: corpus.harvest(model, datasets.Dataset.from_dict({"words": ["a"]}), names, tmp_path / "a"),
         "say which with column="),
        (lambda: corpus.harvest(model, datasets.Dataset.from_dict({"text": ["Mary"]}), names, tmp_path / "a"),
         "context_size is needed"),
        (lambda: corpus.harvest(model, datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}),
                                names, tmp_path / "a"), "pass one split"),
        (lambda: corpus.harvest(model, tokens, names, tmp_path / "a", dtype="float16"), "dtype=float16 differs"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert not (tmp_path / "a" / "manifest.json").exists()


def test_harvest_reports_progress_and_a_cancelled_one_finishes_on_rerun(tl_model, tmp_path, progress_checks):
    names = ["layers.0.layer_output", "layers.1.self_attn.attention_head_outputs"]
    tokens = tokens_for(tl_model, 24)
    options = dict(batch_size=5, shard_size=10)  # shards of 10, 10, 4 rows
    corpus.harvest(tl_model, tokens, names, tmp_path / "plain", progress=False, **options)
    probe = progress_checks.Probe()
    corpus.harvest(tl_model, tokens, names, tmp_path / "watched", progress=probe, **options)
    probe.check_complete("tok")
    assert [s.done for s in probe.steps] == [0, 160, 320, 384]
    assert output_files(tmp_path / "watched") == output_files(tmp_path / "plain")
    # Cancelled after its first shard: the shards written stay, and a rerun finishes the same bytes.
    progress_checks.check_cancelled(tl_model, tokens, lambda progress: corpus.harvest(
        tl_model, tokens, names, tmp_path / "cancelled", progress=progress, **options))
    assert shards_done(tmp_path / "cancelled") == 1
    corpus.harvest(tl_model, tokens, names, tmp_path / "cancelled", progress=False, **options)
    assert output_files(tmp_path / "cancelled") == output_files(tmp_path / "plain")


# -------------------------------------------------------------------------------------------- patch
def ioi_pairs(model, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    pairs = make_ioi_prompts(n, seed, tokenizer=model.tokenizer)
    return {"clean": pairs.clean_tokens, "corrupted": pairs.corrupted_tokens, "answer": pairs.correct,
            "wrong": pairs.incorrect}


def single_pair_results(model, pairs, metric_of):
    """activation_patch on each pair alone: the per-pair values, independent of corpus.patch."""
    return [patching.activation_patch(model, pairs["clean"][j:j + 1], pairs["corrupted"][j:j + 1],
                                      metric_of({k: v[j:j + 1] for k, v in pairs.items()}), "layer_input",
                                      ("layer", "seq"))
            for j in range(len(pairs["clean"]))]


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_patch_is_the_mean_over_pairs(family):
    model = corpus.load_model("embedded", family=family)
    pairs = ioi_pairs(model, 20)
    whole = patching.activation_patch(model, pairs["clean"], pairs["corrupted"],
                                      patching.logit_diff_metric(pairs["answer"], pairs["wrong"]), "layer_input",
                                      ("layer", "seq"))
    singles = single_pair_results(model, pairs, lambda rows: patching.logit_diff_metric(rows["answer"], rows["wrong"]))
    chunked = corpus.patch(model, pairs, "layer_input", ("layer", "seq"), chunk_size=6)  # chunks of 6, 6, 6, 2
    each = corpus.patch(model, pairs, "layer_input", ("layer", "seq"), chunk_size=6, per_pair=True)
    # Per pair: activation_patch on that pair, bit for bit.
    assert torch.equal(each.pair_values, torch.stack([s.values for s in singles]))
    assert each.pair_clean_metric.tolist() == [s.clean_metric for s in singles]
    assert each.pair_corrupted_metric.tolist() == [s.corrupted_metric for s in singles]
    # The mean: activation_patch on all pairs at once, up to the order the float32 terms are summed in.
    bound = 2 * 20 * U32 * float(each.pair_values.abs().max())
    for result in (chunked, each):
        assert (result.axes, result.labels, result.pairs, result.tokens) == (whole.axes, whole.labels, 20, 20 * 16)
        assert float((result.values - whole.values).abs().max()) <= bound
        assert abs(result.clean_metric - whole.clean_metric) <= bound
        assert abs(result.corrupted_metric - whole.corrupted_metric) <= bound


def test_patch_reports_progress_and_stops_when_cancelled(progress_checks):
    model = corpus.load_model("embedded")
    pairs = ioi_pairs(model, 8)
    seq = pairs["clean"].shape[1]
    probe = progress_checks.Probe()
    watched = corpus.patch(model, pairs, "layer_input", ("layer", "seq"), chunk_size=3, progress=probe)
    probe.check_complete("tok")
    assert [s.done for s in probe.steps] == [3 * seq, 6 * seq, 8 * seq]  # chunks of 3, 3, 2 pairs
    plain = corpus.patch(model, pairs, "layer_input", ("layer", "seq"), chunk_size=3, progress=False)
    assert torch.equal(watched.values, plain.values)
    progress_checks.check_cancelled(model, pairs["clean"], lambda progress: corpus.patch(
        model, pairs, "layer_input", ("layer", "seq"), chunk_size=3, progress=progress))


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_patch_keeps_each_pairs_values_whatever_order_chunks_finish_in(order, monkeypatch):
    """Ray finishes chunks in any order; the local engine always in order, so it cannot show a result
    combined in finishing order. An engine that yields its rows out of order, deterministically, can:
    each pair must still get its own values (the mean alone would not notice)."""
    module = sys.modules[corpus.patch.__module__]  # where `patch` looks its engine up
    in_order = module.run

    def out_of_order(*args, **kwargs):
        rows = list(in_order(*args, **kwargs))
        permutation = (range(len(rows) - 1, -1, -1) if order == "reversed"
                       else torch.randperm(len(rows), generator=torch.Generator().manual_seed(1)).tolist())
        assert list(permutation) != list(range(len(rows)))
        yield from (rows[i] for i in permutation)

    monkeypatch.setattr(module, "run", out_of_order)
    model = HookedArcee.from_pretrained("embedded")
    pairs = ioi_pairs(model, 14, seed=2)
    singles = single_pair_results(model, pairs, lambda rows: patching.logit_diff_metric(rows["answer"], rows["wrong"]))
    each = corpus.patch(model, pairs, "layer_input", ("layer", "seq"), chunk_size=4, per_pair=True)  # 4 chunks
    assert torch.equal(each.pair_values, torch.stack([s.values for s in singles]))
    assert each.pair_clean_metric.tolist() == [s.clean_metric for s in singles]
    assert each.pair_corrupted_metric.tolist() == [s.corrupted_metric for s in singles]


def test_patch_with_a_custom_metric_from_a_saved_dataset(tmp_path):
    model = HookedArcee.from_pretrained("embedded")
    pairs = ioi_pairs(model, 12, seed=1)
    datasets.Dataset.from_dict({k: v.tolist() for k, v in pairs.items()}).save_to_disk(str(tmp_path / "pairs"))

    def answer_logprob(logits, rows):  # one value per pair
        return logits[:, -1].log_softmax(-1)[torch.arange(len(logits)), rows["answer"]]

    result = corpus.patch(model, str(tmp_path / "pairs"), "attention_head_outputs", ("layer", "head"),
                          metric=answer_logprob, chunk_size=5, per_pair=True)
    whole = patching.activation_patch(model, pairs["clean"], pairs["corrupted"],
                                      lambda logits: answer_logprob(logits, pairs).mean(), "attention_head_outputs",
                                      ("layer", "head"))
    bound = 2 * 12 * U32 * float(result.pair_values.abs().max())
    assert float((result.values - whole.values).abs().max()) <= bound
    assert result.pair_values.shape == (12, *whole.values.shape)


def test_logit_diff_reads_each_pairs_position():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    rows = {"answer": torch.tensor([1, 2, 3]), "wrong": torch.tensor([4, 5, 6]), "position": torch.tensor([4, 0, 2])}
    expected = torch.stack([logits[i, p, a] - logits[i, p, w]
                            for i, (a, w, p) in enumerate(zip(rows["answer"], rows["wrong"], rows["position"]))])
    assert torch.equal(corpus.logit_diff(logits, rows), expected)
    last = {k: v for k, v in rows.items() if k != "position"}
    mean = patching.logit_diff_metric(last["answer"], last["wrong"])(logits)
    assert torch.equal(corpus.logit_diff(logits, last).mean(), mean)


def test_patch_errors_are_clear():
    model = HookedArcee.from_pretrained("embedded")
    pairs = ioi_pairs(model, 4)
    cases = [
        (dict(pairs={k: v for k, v in pairs.items() if k != "wrong"}), "wrong missing"),
        (dict(pairs={**pairs, "answer": pairs["answer"][:3]}), "differ in length"),
        (dict(pairs={**pairs, "clean": [[1, 2, 3]] * 3 + [[1, 2]]}), "clean prompts differ in length"),
        (dict(metric=lambda logits, rows: logits[:, -1, 0].mean()), r"one value per pair, shape \(2,\); got \(\)"),
        (dict(metric="accuracy"), "metric='accuracy'"),
        (dict(chunk_size=0), "chunk_size=0"),
        (dict(engine="ray"), "pass the checkpoint path"),
    ]
    for change, message in cases:
        arguments = dict(pairs=pairs, metric="logit_diff", chunk_size=2, engine="local")
        arguments.update(change)
        with pytest.raises(ValueError, match=message):
            corpus.patch(model, arguments.pop("pairs"), "layer_input", ("layer", "seq"), **arguments)


# ------------------------------------------------------------------------------------- command line
def test_command_line_harvest_and_patch(tmp_path, capsys):
    model = HookedAlphaEr.from_pretrained("embedded")
    pairs = ioi_pairs(model, 8)
    datasets.Dataset.from_dict({k: v.tolist() for k, v in pairs.items()}).save_to_disk(str(tmp_path / "pairs"))
    torch.save(pairs["clean"], tmp_path / "tokens.pt")
    assert main(["harvest", "--model", "embedded", "--family", "alpha-er", "--names", "blocks.0.hook_resid_post",
                 "--dataset", str(tmp_path / "tokens.pt"), "--out", str(tmp_path / "cli"), "--batch-size", "3",
                 "--no-progress"]) == 0
    line = capsys.readouterr().out
    assert "harvested 1 value(s) over 8 windows x 16 tokens (128 tokens, 1 shards)" in line and "tokens/s" in line
    corpus.harvest(model, pairs["clean"], ["layers.0.layer_output"], tmp_path / "api", batch_size=3)
    assert output_files(tmp_path / "cli").keys() == output_files(tmp_path / "api").keys()
    for name in ("layers.0.layer_output", "token_ids"):
        assert torch.equal(load(tmp_path / "cli")[name], load(tmp_path / "api")[name])
    assert main(["patch", "--model", "embedded", "--family", "alpha_er", "--pairs", str(tmp_path / "pairs"),
                 "--over", "layer", "seq", "--chunk-size", "3", "--top", "3", "--save", str(tmp_path / "r.pt"),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = corpus.patch(model, pairs, "layer_input", ("layer", "seq"), chunk_size=3)
    saved = torch.load(tmp_path / "r.pt", weights_only=False)
    assert torch.equal(saved["values"], expected.values)
    assert printed[1:4] == [f"  {label:<24} {value:.4g}" for label, value in expected.top(3)]
    assert printed[4].startswith("patched 32 locations on 8 pairs (128 prompt tokens) in ")


def test_every_flag_is_explained():
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert sorted(commands) == ["explore", "harvest", "patch", "train-transcoders", "view-graphs"]
    for command in commands.values():
        for action in command._actions:
            assert action.help, f"{command.prog} {action.option_strings} has no help"
