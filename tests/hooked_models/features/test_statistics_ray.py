"""features.statistics with engine="ray" on a local cluster of 2 CPUs (actors reserve half a CPU each, as
corpus's do): the result is the local engine's bit for bit, and a worker killed mid-run has its shard redone."""

import json
import os
import signal
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from hooked_models import features  # noqa: E402

from ..explorer.conftest import ReluSAE, alpha_er, arcee, data_dir, real_graph, sae, transcoders  # noqa: F401, E402


@pytest.fixture(scope="module")
def ray_cluster():
    # The workers import this checkout's hooked_models, whatever the environment's editable install points at.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": root}})
    yield
    ray.shutdown()


def same(a, b) -> bool:
    return all(len(a.layers) == len(b.layers) and
               all(torch.equal(x, y) for x, y in zip(la.partial.tensors().values(), lb.partial.tensors().values()))
               for la, lb in zip(a.layers, b.layers))


def shards_done(out) -> int:
    from safetensors import safe_open

    try:
        with safe_open(str(out / "checkpoint.safetensors"), "pt") as f:
            return len(json.loads(f.metadata()["done"]))
    except Exception:  # not written yet, or being renamed into place
        return 0


def test_ray_equals_local_and_a_killed_worker_is_redone(ray_cluster, arcee, data_dir, transcoders, tmp_path):
    options = dict(model=arcee, k=3, radius=2, batch_size=2, shard_size=2, progress=False)  # 32 shards
    local = features.statistics(data_dir / "acts", transcoders, **options)
    there = features.statistics(data_dir / "acts", transcoders, engine="ray", num_workers=2, **options)
    assert same(local, there)

    out, killed = tmp_path / "ray", []

    def kill_an_actor_once_a_shard_lands():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = shards_done(out)
            actors = [p for p in psutil.Process().children(recursive=True)
                      if "MapBatches(StatisticsWorker)" in " ".join(_cmdline(p))] if done else []
            if actors:
                actors[0].send_signal(signal.SIGKILL)
                killed.append(done)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_an_actor_once_a_shard_lands)
    killer.start()
    again = features.statistics(data_dir / "acts", transcoders, engine="ray", num_workers=2, out=out, **options)
    killer.join()
    assert killed and killed[0] < 32, "no actor was killed mid-run"
    assert same(local, again)


def test_ray_finishes_a_run_whose_checkpoint_holds_every_shard(ray_cluster, arcee, data_dir, sae, tmp_path,
                                                                monkeypatch):
    """Killed after its last checkpoint, before its result was saved: the rerun has no shard left to give
    Ray, and finishes from the checkpoint alone (as the local engine does), the uninterrupted result."""
    import importlib

    from safetensors import safe_open

    module = importlib.import_module("hooked_models.features.statistics")
    options = dict(model=arcee, k=3, radius=2, batch_size=4, shard_size=8, progress=False)  # 8 shards
    local = features.statistics(data_dir / "acts", sae, **options)
    out = tmp_path / "stats"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the result was saved")

    with monkeypatch.context() as patched:
        patched.setattr(module, "_finish", killed)
        with pytest.raises(KeyboardInterrupt):
            features.statistics(data_dir / "acts", sae, out=out, **options)
    with safe_open(str(out / "checkpoint.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["done"]) == list(range(8))
    assert not (out / "statistics.json").exists()
    again = features.statistics(data_dir / "acts", sae, engine="ray", num_workers=2, out=out, **options)
    assert same(local, again)
    assert (out / "statistics.json").exists() and not (out / "checkpoint.safetensors").exists()


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
