"""features.statistics against a brute-force computation over the whole (small) corpus, written here from
the definitions in the statistics' docstrings: every feature's count, min, max, histogram, top windows and
sampled windows, for an SAE, a per-layer transcoder set and a cross-layer transcoder; resumption; bad input.

The oracle reads the harvest with numpy from its Arrow files and applies the SAE to the same batches of rows
(so its activations are the same floats), then computes every statistic directly from all of them."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hooked_models import features
from hooked_models.progress import Cancelled

from ..explorer.conftest import ReluSAE, alpha_er, arcee, data_dir, real_graph, sae, transcoders  # noqa: F401

P = 2**31 - 1  # the priority hash, transcribed from the docstring of features/partial.py


def oracle_priority(index: int, feature: int) -> int:
    h = ((index % P) * 48271 + feature * 69621 + 1_103_515_245) % P
    return (h * 48271 + 1_103_515_245) % P


def harvest_arrays(data_dir, column):
    import datasets

    harvest = datasets.load_from_disk(str(data_dir / "acts")).with_format("numpy")
    return np.stack(harvest["token_ids"]), torch.from_numpy(np.stack(harvest[column]))


def all_activations(encode, acts, batch_size):
    with torch.no_grad():
        return torch.cat([encode(acts[i:i + batch_size]).float() for i in range(0, len(acts), batch_size)])


def brute_force(acts, ids, k, radius, intervals, per_interval, bins):
    """Every feature's statistics, feature by feature, from all activations [row seq d_sae] at once."""
    rows, seq, d = acts.shape
    out = []
    for f in range(d):
        a = acts[..., f]
        flat = a.flatten()
        stats = {"active": int((flat > 0).sum()), "min": float(flat.min()), "max": float(flat.max())}
        top = float(flat.max())
        if top > 0:
            e = int(np.frexp(np.float32(top))[1])  # top = m·2^e, m in [0.5, 1)
            positive = flat[flat > 0].double()
            hist = np.bincount(np.floor(positive.numpy() * bins / 2.0**e).astype(int), minlength=bins)
        else:
            e, hist = None, np.zeros(bins, dtype=int)
        stats["exponent"], stats["histogram"] = e, hist.tolist()

        def window(row, pos):
            lo, hi = max(0, pos - radius), min(seq, pos + radius + 1)
            return row, pos, lo, ids[row, lo:hi].tolist(), a[row, lo:hi].tolist()

        peaks = [(float(a[r].max()), r, int(np.argmax(a[r].numpy()))) for r in range(rows)]
        fired = sorted((p for p in peaks if p[0] > 0), key=lambda p: (-p[0], p[1]))[:k]
        stats["top"] = [window(r, pos) for _, r, pos in fired]
        groups = {}
        for index in range(rows * seq):
            value = float(flat[index])
            if value > 0:
                g = int(np.floor(np.float64(value) * intervals / 2.0**e))
                groups.setdefault(g, []).append((oracle_priority(index, f), index))
        stats["samples"] = {g: sorted(window(*divmod(i, seq)) for _, i in sorted(c)[:per_interval])
                            for g, c in groups.items()}
        out.append(stats)
    return out


def check_against(layer, expected, strings):
    part = layer.partial
    for f, want in enumerate(expected):
        assert int(part.active[f]) == want["active"]
        assert float(part.act_min[f]) == want["min"] and float(part.act_max[f]) == want["max"]
        assert part.histogram[f].tolist() == want["histogram"], f
        assert layer.frequency()[f] == want["active"] / part.tokens
        top = layer.top_windows(f)
        assert [(w.row, w.position, w.start, w.tokens, w.activations) for w in top] == [
            (r, p, lo, strings(t), acts) for r, p, lo, t, acts in want["top"]]
        got = {}
        for low, high, windows in layer.interval_windows(f):
            width = layer.range_top(f) / part.limits.intervals
            g = round(low / width)
            assert (low, high) == (g * width, (g + 1) * width)
            got[g] = sorted((w.row, w.position, w.start, w.tokens, w.activations) for w in windows)
        assert got == {g: sorted((r, p, lo, strings(t), acts) for r, p, lo, t, acts in ws)
                       for g, ws in want["samples"].items()}, f


@pytest.mark.parametrize("radius", [0, 3])
def test_every_feature_of_an_sae_equals_brute_force(arcee, data_dir, sae, radius):
    ids, x = harvest_arrays(data_dir, "layers.1.layer_output")
    options = dict(k=4, radius=radius, intervals=4, per_interval=3, bins=16)
    stats = features.statistics(data_dir / "acts", sae, model=arcee, batch_size=7, shard_size=14, progress=False,
                                **options)
    (layer,) = stats.layers
    assert layer.name == "layers.1.layer_output" and layer.partial.tokens == 64 * 16 and stats.rows == 64
    acts = all_activations(sae.encode, x, 7)
    expected = brute_force(acts, ids, **options)
    assert sum(len(e["top"]) for e in expected) > 32 and any(len(e["samples"]) > 1 for e in expected)
    check_against(layer, expected, arcee.to_str_tokens)
    # the logits: W_dec[f] @ W_U, the ten largest and smallest
    logits = sae.W_dec.detach() @ arcee.W_U
    assert torch.equal(layer.top_logits, logits.topk(10, dim=-1).indices)
    assert torch.equal(layer.bottom_values, logits.topk(10, dim=-1, largest=False).values)


@pytest.mark.parametrize("kind", ["set", "cross-layer"])
def test_every_feature_of_transcoders_equals_brute_force(arcee, data_dir, transcoders, kind):
    from hooked_models.transcoders import CrossLayerTranscoder

    tcs = transcoders
    if kind == "cross-layer":
        tcs = CrossLayerTranscoder(2, 64, 8, model=arcee)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in tcs.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    options = dict(k=3, radius=2, intervals=2, per_interval=2, bins=8)
    stats = features.statistics(data_dir / "acts", tcs, model=arcee, batch_size=16, progress=False, **options)
    assert [layer.name for layer in stats.layers] == ["layers.0.mlp_input", "layers.1.mlp_input"]
    for layer in (0, 1):
        ids, x = harvest_arrays(data_dir, f"layers.{layer}.mlp_input")
        acts = all_activations(lambda v: tcs.encode(layer, v), x, 16)
        check_against(stats[layer], brute_force(acts, ids, **options), arcee.to_str_tokens)
        direction = tcs.W_dec[layer].detach().sum(1) if kind == "cross-layer" else tcs[layer].W_dec.detach()
        expected = (direction @ arcee.W_U).topk(10, dim=-1)
        assert torch.equal(stats[layer].top_logits, expected.indices)
        assert torch.allclose(stats[layer].top_values, expected.values, rtol=1e-5, atol=0)


def test_merging_does_not_depend_on_the_cut_or_the_order(sae, data_dir):
    ids, x = harvest_arrays(data_dir, "layers.1.layer_output")
    acts = all_activations(sae.encode, x, 64)
    ids = torch.from_numpy(ids)
    limits = features.Limits(32, k=5, intervals=4, per_interval=2, bins=16, radius=2)
    whole = features.partial.of_batch(acts, ids, 0, limits)
    cuts = [0, 3, 4, 20, 41, 64]
    pieces = [features.partial.of_batch(acts[a:b], ids[a:b], a, limits) for a, b in zip(cuts, cuts[1:])]
    merged = features.Partial.empty(limits)
    for piece in reversed(pieces):
        merged = features.merge(piece, merged)
    for name, tensor in whole.tensors().items():
        assert torch.equal(tensor, merged.tensors()[name]), name


def test_a_cancelled_run_finishes_on_rerun_with_the_uninterrupted_result(arcee, data_dir, sae, tmp_path):
    options = dict(model=arcee, k=3, radius=2, batch_size=4, shard_size=8, progress=False)
    whole = features.statistics(data_dir / "acts", sae, **options)
    steps = []

    def stop_midway(step):
        steps.append(step.done)
        if len(steps) == 12:  # the first report, then 11 batches: shards 0-4 checkpointed, shard 5 half done
            raise Cancelled("stopped")

    out = tmp_path / "stats"
    with pytest.raises(Cancelled):
        features.statistics(data_dir / "acts", sae, out=out, **{**options, "progress": stop_midway})
    assert not (out / "statistics.json").exists()  # nothing a rerun would take for a result
    from safetensors import safe_open

    with safe_open(str(out / "checkpoint.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["done"]) == [0, 1, 2, 3, 4]
    resumed = []
    again = features.statistics(data_dir / "acts", sae, out=out, **{**options, "progress": resumed.append})
    assert resumed[0].done == 5 * 8 * 16 and resumed[-1].done == 64 * 16
    for a, b in zip(whole.layers[0].partial.tensors().values(), again.layers[0].partial.tensors().values()):
        assert torch.equal(a, b)
    loaded = features.FeatureStatistics.load(out)
    assert loaded.layers[0].top_windows(3) == whole.layers[0].top_windows(3)
    assert features.statistics(data_dir / "acts", sae, out=out, **options).job == whole.job  # a finished one loads


def test_a_run_whose_shards_finished_out_of_order_resumes_with_the_uninterrupted_result(arcee, data_dir, sae,
                                                                                        tmp_path, monkeypatch):
    """Ray hands shards back in any order, so a checkpoint's finished shards need not be the first ones: an
    engine that runs them last first is cancelled after three (shards 7 and 6 checkpointed, 5 not), and
    the rerun runs the other six, each once: the uninterrupted result bit for bit."""
    from safetensors import safe_open

    import importlib

    from hooked_models.corpus import engines

    module = importlib.import_module("hooked_models.features.statistics")  # the package names the function so

    options = dict(model=arcee, k=3, radius=2, batch_size=4, shard_size=8, progress=False)  # 8 shards of 8 rows
    whole = features.statistics(data_dir / "acts", sae, **options)
    shard_tokens = 8 * 16

    def last_first(worker_cls, model, plan, items, engine, num_workers):
        return engines.run(worker_cls, model, plan, items[::-1], "local", 1)

    def stop_after_three(step):
        if step.done >= 3 * shard_tokens:
            raise Cancelled("stopped")

    out = tmp_path / "stats"
    with monkeypatch.context() as patched:
        patched.setattr(module, "run", last_first)
        with pytest.raises(Cancelled):
            features.statistics(data_dir / "acts", sae, out=out, engine="ray",
                                **{**options, "progress": stop_after_three})
    with safe_open(str(out / "checkpoint.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["done"]) == [6, 7]
    resumed = []
    again = features.statistics(data_dir / "acts", sae, out=out, **{**options, "progress": resumed.append})
    assert resumed[0].done == 2 * shard_tokens and resumed[-1].done == 64 * 16
    for a, b in zip(whole.layers[0].partial.tensors().values(), again.layers[0].partial.tensors().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_through_the_model_equals_over_its_harvest(arcee, data_dir, sae, tmp_path):
    import datasets

    from hooked_models.embedded.task import make_ioi_prompts

    datasets.Dataset.from_dict({"text": make_ioi_prompts(64, 0).clean_text}).save_to_disk(str(tmp_path / "text"))
    options = dict(k=3, radius=1, batch_size=32, progress=False)
    there = features.statistics(arcee, sae, dataset=str(tmp_path / "text"), context_size=16, **options)
    here = features.statistics(data_dir / "acts", sae, model=arcee, **options)
    for a, b in zip(there.layers[0].partial.tensors().values(), here.layers[0].partial.tensors().values()):
        assert torch.equal(a, b)


def test_bad_input_is_a_clear_error_and_leaves_nothing(arcee, data_dir, sae, tmp_path):
    out = tmp_path / "stats"
    wide = ReluSAE(40, 8, "blocks.1.hook_resid_post")
    with pytest.raises(ValueError, match=r"reads 40-wide inputs; the harvest's column 'layers.1.layer_output' is 64"):
        features.statistics(data_dir / "acts", wide, model=arcee, out=out)
    elsewhere = ReluSAE(64, 8, "blocks.0.hook_resid_post")
    with pytest.raises(ValueError, match=r"no column 'layers.0.layer_output', the value ReluSAE reads; it holds "
                                         r"\['layers.1.layer_output', 'layers.0.mlp_input', 'layers.1.mlp_input'\]"):
        features.statistics(data_dir / "acts", elsewhere, model=arcee, out=out)
    for k in (0, -1):
        with pytest.raises(ValueError, match=f"k={k} must be a positive integer"):
            features.statistics(data_dir / "acts", sae, model=arcee, k=k, out=out)
    with pytest.raises(ValueError, match="the dataset has no rows"):
        features.statistics(arcee, sae, dataset=np.zeros((0, 16), dtype=np.int64), out=out)
    assert not out.exists()


def test_a_local_run_imports_no_ray(data_dir):
    import subprocess
    import sys

    code = ("import sys, torch; from hooked_models import features, HookedArcee; "
            "sae = torch.nn.Module(); sae.W_enc = torch.nn.Parameter(torch.randn(64, 4)); "
            "sae.W_dec = torch.nn.Parameter(torch.randn(4, 64)); sae.hook_name = 'layers.1.layer_output'; "
            "sae.encode = lambda x: torch.relu(x @ sae.W_enc); "
            f"features.statistics({str(data_dir / 'acts')!r}, sae, model=HookedArcee.from_pretrained('embedded'), "
            "progress=False); print('ray' in sys.modules)")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[3])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": root})
    assert done.stdout.strip() == "False", done.stderr


def test_a_killed_run_finishes_on_rerun_with_the_uninterrupted_result(arcee, data_dir, sae, tmp_path):
    """SIGKILL mid-run (in a child process, after 7 batches: shards 0-2 checkpointed, shard 3 half done)."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "stats"
    torch.save(sae, tmp_path / "sae.pt")
    code = (f"import os, signal, sys, torch; sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
            "from hooked_models import HookedArcee, features\n"
            f"sae = torch.load({str(tmp_path / 'sae.pt')!r}, weights_only=False)\n"
            "steps = []\n"
            "def kill(step):\n    steps.append(step)\n"
            "    if len(steps) == 8: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"features.statistics({str(data_dir / 'acts')!r}, sae, model=HookedArcee.from_pretrained('embedded'), "
            f"out={str(out)!r}, k=3, radius=2, batch_size=4, shard_size=8, progress=kill)\n")
    root = str(Path(__file__).resolve().parents[3])
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root},
                          capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not (out / "statistics.json").exists() and (out / "checkpoint.safetensors").exists()
    again = features.statistics(data_dir / "acts", sae, model=arcee, out=out, k=3, radius=2, batch_size=4,
                                shard_size=8, progress=False)
    whole = features.statistics(data_dir / "acts", sae, model=arcee, k=3, radius=2, batch_size=4, progress=False)
    for a, b in zip(whole.layers[0].partial.tensors().values(), again.layers[0].partial.tensors().values()):
        assert torch.equal(a, b)
