"""`train_transcoders_on_ray`: the same training launched by Ray Train instead of torchrun.

Ray Train's `TorchTrainer` starts the workers and sets up their torch.distributed group (gloo); each
calls `train_transcoders`, which finds the group set up, so the arithmetic is torchrun's. Process 0 writes
the result directory (`train_transcoders`'s `out=`) and hands it to Ray Train as the run's checkpoint,
which Ray copies to its storage; the caller reads it from there, so the result reaches this process
whichever node process 0 ran on. Ray is imported only when this is called.
"""

import os
import tempfile
from pathlib import Path

# The exceptions that are a user's error in the worker that raised them (the command line's one-liners).
_USER_ERRORS = (ValueError, KeyError, OSError, ImportError)


def train_transcoders_on_ray(source, *, num_workers: int = 2, cpus_per_worker: float | None = None,
                             out: str | os.PathLike | None = None, storage_path: str | os.PathLike | None = None,
                             **train_kwargs):
    """`train_transcoders(source, **train_kwargs)` in `num_workers` Ray Train workers, one process each of one
    torch.distributed group (gloo, on the CPU); returns what process 0 trained, as `train_transcoders` does.

    source, dataset: paths every worker opens ("embedded", a checkpoint, a harvest; a dataset directory or a
      token file), or objects Ray copies to each worker (token ids; a hooked model, copied whole).
    cpus_per_worker: the CPUs each worker reserves; default 1, or the cluster's CPUs shared among the workers
      where it has fewer than `num_workers` (fractional: whole CPUs on a small machine leave Ray waiting for
      ever).
    out: the result directory (as `train_transcoders` writes it), written on this machine.
    storage_path: where Ray Train keeps the run and the result on its way here: on a cluster of several
      machines, a directory every node reaches (a shared file system, cloud storage). Default: a temporary
      directory on this machine, removed afterwards. A `checkpoint=` directory too must be one every
      worker reaches.

    Joins the cluster this process or RAY_ADDRESS names, else starts one on this machine for the call. An
    error a worker raised is raised here as it was raised there (a ValueError naming the argument, ...).
    """
    from hooked_models.corpus.engines import ray_cluster
    from hooked_models.transcoders.training.distributed import check_layout
    from hooked_models.transcoders.training.report import read_result

    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} must be a positive integer")
    if cpus_per_worker is not None and (isinstance(cpus_per_worker, bool) or
                                        not isinstance(cpus_per_worker, (int, float)) or cpus_per_worker <= 0):
        raise ValueError(f"cpus_per_worker={cpus_per_worker!r} must be a positive number")
    config = train_kwargs.get("config")
    if config is not None:  # refused here, before a cluster starts, as each worker would refuse it
        check_layout(config.layout, config.d_transcoder, num_workers)
    with ray_cluster() as ray, tempfile.TemporaryDirectory(prefix="train_transcoders-") as scratch:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        if cpus_per_worker is None:
            cpus_per_worker = min(1.0, ray.cluster_resources().get("CPU", 1.0) / num_workers)
        trainer = TorchTrainer(
            _worker, train_loop_config={"source": source, "kwargs": train_kwargs},
            scaling_config=ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": cpus_per_worker}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(name="train_transcoders", storage_path=str(storage_path or scratch)))
        try:
            result = trainer.fit()
        except Exception as error:
            cause = _worker_error(error)
            if cause is error:
                raise
            raise cause from error
        where = Path(out) if out is not None else Path(scratch) / "result"
        result.checkpoint.to_directory(str(where))
        return read_result(where)


def _worker(job: dict) -> None:
    """One Ray Train worker: train in the group Ray set up; process 0 reports the result directory."""
    import ray.train

    from hooked_models.transcoders.training.trainer import train_transcoders

    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory(prefix="train_transcoders-") as out:
        train_transcoders(job["source"], out=out, **job["kwargs"])
        checkpoint = ray.train.Checkpoint.from_directory(out) if rank == 0 else None
        ray.train.report({"rank": rank}, checkpoint=checkpoint)


def _worker_error(error: Exception) -> Exception:
    """The error a worker raised, as it raised it: a user's error first (another worker's failure is often
    only its peer leaving a collective), else the lowest rank's; `error` itself when no worker raised."""
    failures = [getattr(f, "cause", f) for _, f in sorted(getattr(error, "worker_failures", {}).items())]
    for failure in failures:
        if isinstance(failure, _USER_ERRORS):
            return failure
    return failures[0] if failures and isinstance(failures[0], Exception) else error
