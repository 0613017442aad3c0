"""Where the units of a corpus run execute: "local" (this process) or "ray" (Ray Data's `map_batches` over an
actor pool, one model replica per actor). One callable class does a unit per call under either engine;
Ray is imported only for engine="ray"."""

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from hooked_models.corpus import ENGINES
from hooked_models.corpus.source import ModelSource
# Ray actors reserve part of a CPU: whole CPUs per actor starve the read stage on a small machine.
ACTOR_CPUS = 0.5


def check_engine(engine: str, num_workers: int) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} must be one of {', '.join(ENGINES)}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} must be a positive integer")
    if engine == "local" and num_workers != 1:
        raise ValueError(f"engine='local' runs one worker in this process; num_workers={num_workers} "
                         "needs engine='ray'")


class Shards:
    """Rows cut into shards of `shard_size` (a plan's `rows` and `shard_size` fields): the unit a worker takes."""

    def shard_rows(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_size, min((shard + 1) * self.shard_size, self.rows)

    @property
    def shards(self) -> int:
        return -(-self.rows // self.shard_size)


def pool_size(num_workers: int, units: int) -> int:
    """The workers a run starts: `num_workers`, but no more than there are units of work to give them."""
    return max(1, min(num_workers, units))


def run(worker_cls, model, plan, items: list[dict], engine: str, num_workers: int) -> Iterator[dict]:
    """Each item through `worker_cls(model, plan)`, one item per call; yields each call's output row
    as it completes (in any order under Ray). The pool has `pool_size(num_workers, len(items))` actors:
    a replica with no unit to take would load the model and idle. No items (a resumed run with every
    unit done): nothing runs, and no cluster is joined (Ray Data refuses an empty dataset)."""
    if not items:
        return
    if engine == "local":
        worker = worker_cls(model, plan)
        for item in items:
            yield _first_row(worker({k: np.asarray([v]) for k, v in item.items()}))
        return
    with ray_cluster() as ray:
        context = ray.data.DataContext.get_current()
        bars, context.enable_progress_bars = context.enable_progress_bars, False
        try:
            resources = {"num_gpus": 1} if ray.cluster_resources().get("GPU", 0) > 0 else {}
            units = ray.data.from_items(items, override_num_blocks=min(len(items), 10000))
            results = units.map_batches(
                worker_cls, fn_constructor_kwargs={"model": model, "plan": plan}, batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=pool_size(num_workers, len(items))), num_cpus=ACTOR_CPUS, **resources)
            yield from results.iter_rows()
        finally:
            context.enable_progress_bars = bars


def _first_row(batch: dict) -> dict:
    return {k: v[0] for k, v in batch.items()}


# Ray logs this on every start of a local cluster: token authentication, its default, is on. Only this
# notice is dropped; the logger's other messages (authentication off, a token missing) still show.
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


@contextmanager
def _quiet_auth_notice():
    logger = logging.getLogger(_AUTH_LOGGER)
    drop = lambda record: not record.getMessage().startswith(_AUTH_NOTICE)  # noqa: E731
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextmanager
def ray_cluster():
    """Ray, joined to the running cluster (this process's `ray.init`, or RAY_ADDRESS), else a local
    one started for the call and shut down after it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError("engine='ray' needs Ray Data: pip install 'ray[data]' "
                          "(or this package's corpus extra)") from None
    started = not ray.is_initialized()
    if started:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            with _quiet_auth_notice():
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def _worker_device() -> str:
    """A Ray actor's device: the GPU Ray gave it, else the CPU."""
    try:
        import ray

        if ray.is_initialized() and ray.get_gpu_ids():
            return "cuda"
    except ImportError:
        pass
    return "cpu"


class Worker:
    """Loads its replica once (or takes the model object, locally) and computes with the driver's
    torch thread count, so a worker's arithmetic is the local run's."""

    def __init__(self, model, plan):
        torch.set_num_threads(plan.threads)
        self.plan = plan
        self.model = model.load(_worker_device()) if isinstance(model, ModelSource) else model
