"""The Ray engine of hooked_models/corpus/ on a local cluster (`ray.init(num_cpus=2)`, joined by the
runs, or started and stopped by one when none runs): its output is the local engine's bit for bit, and a
worker killed mid-run is replaced with no shard missing or written twice."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
datasets = pytest.importorskip("datasets")

from hooked_models import corpus  # noqa: E402
from hooked_models.embedded.task import make_ioi_prompts  # noqa: E402


def test_with_no_cluster_a_run_starts_one_and_stops_it(monkeypatch):
    # The workers of a cluster the run starts inherit this process's environment (this checkout's PYTHONPATH).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    model = corpus.load_model("embedded")
    ioi = make_ioi_prompts(4, 2, tokenizer=model.tokenizer)
    pairs = {"clean": ioi.clean_tokens, "corrupted": ioi.corrupted_tokens, "answer": ioi.correct,
             "wrong": ioi.incorrect}
    there = corpus.patch("embedded", pairs, "mlp_output", ("layer",), engine="ray")
    assert not ray.is_initialized()
    assert torch.equal(there.values, corpus.patch(model, pairs, "mlp_output", ("layer",)).values)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster of 2 CPUs for this module; the runs join it (as they join one RAY_ADDRESS names)."""
    # The workers import this checkout's hooked_models, whatever the environment's editable install points at.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": root}})
    yield
    ray.shutdown()


def output_files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != ".lock"}


def shards_done(out) -> int:
    """How many shards the manifest records (it is replaced whole, never seen half-written)."""
    try:
        runs = json.loads((out / "manifest.json").read_text())["shards"]
    except FileNotFoundError:
        return 0
    return sum(run["shards"][1] - run["shards"][0] for run in runs)


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def actor_processes(worker: str) -> list[psutil.Process]:
    """This test's Ray actors running `worker` (descendants of this process only)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if f"MapBatches({worker})" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_a_killed_ray_worker_is_replaced_and_the_output_is_the_local_one(ray_cluster, tmp_path):
    tokens = np.random.default_rng(1).integers(0, 127, (512, 16))
    names = ["layers.0.self_attn.attention_output", "blocks.1.hook_resid_post"]
    options = dict(batch_size=4, shard_size=4)  # 128 shards
    corpus.harvest("embedded", tokens, names, tmp_path / "local", **options)
    out, killed = tmp_path / "ray", []

    def kill_an_actor_once_a_shard_lands():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = shards_done(out)
            actors = actor_processes("HarvestWorker") if done else []
            if actors:
                actors[0].send_signal(signal.SIGKILL)
                killed.append((actors[0], done))
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_an_actor_once_a_shard_lands)
    killer.start()
    summary = corpus.harvest("embedded", tokens, names, out, engine="ray", num_workers=2, **options)
    killer.join()
    assert killed and killed[0][1] < 128, "no actor was killed mid-run"
    assert gone(killed[0][0])
    assert summary.shards_run == 128
    assert json.loads((out / "manifest.json").read_text())["shards"] == [{"shards": [0, 128], "rows": [0, 512]}]
    assert output_files(out) == output_files(tmp_path / "local")


def test_ray_equals_local_alpha_er_harvest_and_patch(ray_cluster, tmp_path):
    model = corpus.load_model("embedded", family="alpha_er")
    texts = make_ioi_prompts(48, 0, tokenizer=model.tokenizer).clean_text
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "text"))
    job = dict(context_size=16, batch_size=8, shard_size=16, family="alpha_er")
    corpus.harvest("embedded", str(tmp_path / "text"), ["blocks.1.hook_mlp_out"], tmp_path / "local", **job)
    corpus.harvest("embedded", str(tmp_path / "text"), ["blocks.1.hook_mlp_out"], tmp_path / "ray", engine="ray",
                   **job)
    assert output_files(tmp_path / "ray") == output_files(tmp_path / "local")

    pairs = make_ioi_prompts(12, 1, tokenizer=model.tokenizer)
    pairs = {"clean": pairs.clean_tokens, "corrupted": pairs.corrupted_tokens, "answer": pairs.correct,
             "wrong": pairs.incorrect}
    here = corpus.patch(model, pairs, "attention_head_outputs", ("layer", "head"), chunk_size=5, per_pair=True)
    there = corpus.patch("embedded", pairs, "attention_head_outputs", ("layer", "head"), chunk_size=5,
                         per_pair=True, engine="ray", num_workers=2, family="alpha_er")
    assert torch.equal(there.values, here.values) and torch.equal(there.pair_values, here.pair_values)
    assert (there.clean_metric, there.corrupted_metric) == (here.clean_metric, here.corrupted_metric)
    assert (there.axes, there.labels) == (here.axes, here.labels)
