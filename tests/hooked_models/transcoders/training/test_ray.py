"""Ray Train as the second launcher (`train_transcoders_on_ray`, `train-transcoders --engine ray`): two workers
with half a CPU each, on a local cluster of 2 CPUs, train what one process trains within float32 rounding,
and the caller gets the result from process 0; a worker's error is raised to the caller as it was raised."""

import json
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

from hooked_models.__main__ import main  # noqa: E402
from hooked_models.transcoders import load_transcoders  # noqa: E402
from hooked_models.transcoders import training  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster of 2 CPUs for this module, which the runs join (as they join one RAY_ADDRESS names)."""
    # The workers import this checkout's hooked_models, whatever the environment's editable install points at.
    root = str(Path(__file__).resolve().parents[4])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": root}})
    yield
    ray.shutdown()


def test_ray_workers_train_what_one_process_trains(ray_cluster, small_run, monkeypatch, capsys):
    """Data parallel over 2 Ray Train workers: within 2e-6 of each tensor's largest entry (measured: 2e-7);
    what the function returns is what it wrote to --out, bit for bit."""
    launched = []

    def recorded(*args, **kwargs):
        launched.append((kwargs, launch(*args, **kwargs)))
        return launched[-1][1]

    launch = training.train_transcoders_on_ray
    monkeypatch.setattr(training, "train_transcoders_on_ray", recorded)
    where, trained, flags = small_run
    out = where / "ray"
    assert main(["train-transcoders", "embedded", "--dataset", str(where / "tokens.pt"), "--out", str(out),
                 "--engine", "ray", "--workers", "2", "--cpus-per-worker", "0.5", *flags]) == 0
    (kwargs, returned), = launched
    assert (kwargs["num_workers"], kwargs["cpus_per_worker"]) == (2, 0.5)
    assert json.loads((out / "training.json").read_text())["run"]["processes"] == 2
    assert "2 processes (data)" in capsys.readouterr().out
    written = load_transcoders(out).state_dict().values()
    for (name, a), b, c in zip(trained.state_dict().items(), returned.state_dict().values(), written, strict=True):
        assert float((a - b).abs().max()) <= 2e-6 * float(a.abs().max()), name
        assert torch.equal(b, c), name


def test_a_workers_error_reaches_the_caller_as_raised():
    """A user's error first (the other worker's is often its peer leaving a collective), else the lowest
    rank's; an error of Ray's own is raised as it is."""
    from ray.train import WorkerGroupError

    from hooked_models.transcoders.training.ray_launcher import _worker_error

    user, peer, other = ValueError("layers=(0, 5): ..."), RuntimeError("Connection closed by peer"), RuntimeError()
    assert _worker_error(WorkerGroupError("", {0: peer, 1: user})) is user
    assert _worker_error(WorkerGroupError("", {1: other, 0: peer})) is peer
    assert _worker_error(other) is other
