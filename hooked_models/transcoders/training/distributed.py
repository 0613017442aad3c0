"""The process group and the two layouts training runs in, on `torch.distributed` itself.

A process started alone is a process group of one (gloo over an in-memory store), so one code path runs
alone, under `torchrun` (gloo on CPU, nccl on GPUs) and under Ray Train's `TorchTrainer` (which sets the
group up before the training function runs).

- Data parallel (`layout="data"`): each process holds every feature and trains on its share of each
  batch; losses are sums over its tokens divided by the global batch's totals, so the all-reduced (summed)
  gradients are the global batch's.
- Feature sharded (`layout="features"`, crosslayer-coding's layout): each process holds 1/N of every layer's
  features (encoder columns, decoder rows, thresholds, their optimizer state) and sees the whole batch;
  the reconstruction is the sum of the shards' partial ones, a TopK is chosen globally from each shard's
  candidates, and the replicated parameters (decoder bias, skip) get the same gradient everywhere.
"""

import atexit
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch import Tensor


def default_device() -> torch.device:
    """Where a process trains unless told: its own GPU under torchrun on a machine with GPUs
    (`cuda:LOCAL_RANK`), the GPU alone where there is one, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


@contextlib.contextmanager
def process_group(device: torch.device = torch.device("cpu"), timeout_s: float = 600.0):
    """The default process group: the one already set up (Ray Train, a caller), one from torchrun's
    environment (nccl for processes training on GPUs, gloo on CPUs; kept for the process's life: a second
    training in the process reuses it, as re-creating it on the same store can hang), or a group of one,
    destroyed on leaving."""
    if dist.is_initialized():
        yield
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
        atexit.register(_destroy)
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class _SumAcrossShards(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward. Every process computes the same loss from the summed
    value, so each already holds the whole gradient of its own partial (torch.distributed.nn's all_reduce
    would sum those gradients again, N times too large: Megatron's "reduce from model-parallel region")."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def check_layout(kind: str, d_transcoder: int, world: int) -> None:
    """Feature sharding needs a width that the process count divides."""
    if kind == "features" and d_transcoder % world:
        raise ValueError(f"d_transcoder={d_transcoder} is not divisible by the {world} processes that shard its "
                         "features: choose a width that is")


class Layout:
    """Where this process stands: its rank, the process count, and how features and tokens are split."""

    def __init__(self, kind: str, d_transcoder: int, device: torch.device = torch.device("cpu")):
        self.kind, self.rank, self.world, self.device = kind, dist.get_rank(), dist.get_world_size(), device
        check_layout(kind, d_transcoder, self.world)
        self.d_transcoder = d_transcoder
        self.d_local = d_transcoder // self.world if kind == "features" else d_transcoder

    @property
    def sharded(self) -> bool:
        return self.kind == "features" and self.world > 1

    @property
    def features(self) -> slice:
        """This process's features of every layer."""
        start = self.rank * self.d_local if self.kind == "features" else 0
        return slice(start, start + self.d_local)

    def sum_partials(self, x: Tensor) -> Tensor:
        """The sum over feature shards of a partial reconstruction (differentiable; itself unsharded)."""
        return _SumAcrossShards.apply(x) if self.sharded else x

    def sum_tokens(self, x: Tensor) -> Tensor:
        """A statistic summed over every process's tokens (data parallel; the batch is whole otherwise)."""
        if self.kind == "data" and self.world > 1:
            x = x.clone()
            dist.all_reduce(x)
        return x

    def sum_features(self, x: Tensor) -> Tensor:
        """A count over features summed over the feature shards (whole already when data parallel)."""
        if self.sharded:
            x = x.clone()
            dist.all_reduce(x)
        return x

    def sum_all(self, x: Tensor) -> Tensor:
        """A count split over the processes whichever the layout (tokens or features): their sum."""
        if self.world > 1:
            x = x.clone()
            dist.all_reduce(x)
        return x

    def any_tokens(self, fired: Tensor) -> Tensor:
        """Whether a feature fired on any process's tokens."""
        if self.kind == "data" and self.world > 1:
            fired = fired.to(torch.int32)
            dist.all_reduce(fired, op=dist.ReduceOp.MAX)
        return fired.bool()

    def reduce_gradients(self, params) -> None:
        """Data parallel: sum each gradient over the processes (each holds its tokens' share)."""
        if self.kind != "data" or self.world == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def gather_features(self, x: Tensor, dim: int = -1) -> Tensor:
        """Feature-sharded: every process's slice of the feature axis `dim`, concatenated in rank order."""
        if not self.sharded:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def gather_tokens(self, x: Tensor) -> Tensor:
        """Feature-sharded: the whole batch from every process's share of it (axis -2, in rank order)."""
        if not self.sharded:
            return x
        sizes = [torch.zeros((), dtype=torch.int64, device=x.device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor(x.shape[-2], device=x.device))
        if len({int(s) for s in sizes}) != 1:
            raise ValueError(f"the processes' shares of a batch differ in size ({[int(s) for s in sizes]} tokens)")
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-2)

    def kth_largest(self, values: Tensor, k: int, whole_batch: bool = False) -> Tensor:
        """Per row (every axis but the last), the k-th largest of the row over every shard of it: each
        process offers its k largest candidates, and the global k-th is chosen from those (what an
        unsharded topk keeps is exactly what is >= it, ties aside). A row is a token's features, split only
        by feature sharding; `whole_batch`: `values` is this process's whole batch flattened, a row split
        by data parallelism too."""
        local = values.topk(min(k, values.shape[-1]), dim=-1).values
        if local.shape[-1] < k:
            pad = local.new_full((*local.shape[:-1], k - local.shape[-1]), -torch.inf)
            local = torch.cat([local, pad], dim=-1)
        if not (self.sharded or (whole_batch and self.world > 1)):
            return local[..., -1:]  # topk's values come sorted: the row is whole here, its k-th is the last
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1).topk(k, dim=-1).values[..., -1:]

    def barrier(self) -> None:
        dist.barrier()
