"""`harvest`: the activations of named values over a corpus, written to disk in SAELens's
cached-activations layout, a shard per unit of work."""

import itertools
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from hooked_models.corpus.data import read_corpus, require_datasets, window_batches
from hooked_models.corpus.engines import Shards, Worker, check_engine, pool_size, run
from hooked_models.corpus.source import model_identity, resolve_model
from hooked_models.corpus.store import (
    FORMAT,
    MANIFEST,
    SHARD_FILE,
    WINDOWS,
    Manifest,
    check_out,
    clear_leftovers,
    finish,
    leftovers,
    locked,
    read_windows,
    refuse_mismatch,
    shard_file,
    stage_windows,
)
from hooked_models.hooks import ValueHook
from hooked_models.progress import ProgressArg, tracker

# Arrow has no bfloat16: it is stored widened to float32, which is exact.
STORAGE = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64", torch.bfloat16: "float32"}
# A shard holds about this many bytes of activations (a whole number of batches, at least one).
SHARD_BYTES = 64 * 2**20


@dataclass(frozen=True)
class HarvestPlan(Shards):
    """What every worker needs to compute and write a shard (sent to Ray actors)."""

    out: str
    names: tuple[str, ...]
    stop_at_layer: int | None
    context_size: int
    batch_size: int
    shard_size: int
    rows: int
    features: object  # datasets.Features
    threads: int


def _per_position(tensor: Tensor, value) -> Tensor:
    """A value as [batch seq rest]: its position axis second, the other dimensions flattened in order
    (TransformerLens's `hook_z` [batch pos head d_head] flattened, as SAELens stores it)."""
    return tensor.movedim(value.seq_axis % tensor.ndim, 1).reshape(tensor.shape[0], tensor.shape[value.seq_axis], -1)


def _activations(model, tokens: Int[Tensor, "batch seq"], names, stop_at_layer) -> dict[str, Tensor] | None:
    """The named values of one batch, [batch seq rest] each, running the layers below `stop_at_layer`
    only (None: all); None if a value did not fire in that partial run."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=list(names), stop_at_layer=stop_at_layer,
                                        return_cache_object=False)
    if not all(name in cache for name in names):
        return None
    return {name: _per_position(cache[name], model.standard_hook_dict[name].value) for name in names}


class HarvestWorker(Worker):
    """One shard per call: its windows, batch by batch through the model, into one Arrow file written
    under a temporary name and renamed into place (a killed worker leaves no partial shard)."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        plan, out = self.plan, Path(self.plan.out)
        device = next(self.model.parameters()).device
        done = []
        for shard in batch["shard"].tolist():
            start, stop = plan.shard_rows(shard)
            windows = read_windows(out / WINDOWS, start, stop, plan.context_size)
            temporary = out / ".tmp" / f"{shard_file(shard)}.{uuid.uuid4().hex}"
            writer = require_datasets().arrow_writer.ArrowWriter(features=plan.features, path=str(temporary))
            try:
                for first in range(0, len(windows), plan.batch_size):
                    tokens = torch.from_numpy(windows[first:first + plan.batch_size]).long().to(device)
                    values = _activations(self.model, tokens, plan.names, plan.stop_at_layer)
                    columns = {name: _storable(values[name], plan.features[name].dtype) for name in plan.names}
                    writer.write_batch({**columns, "token_ids": windows[first:first + plan.batch_size]})
                writer.finalize()
            finally:
                writer.close()
            os.replace(temporary, out / shard_file(shard))
            done.append(shard)
        return {"shard": np.asarray(done, dtype=np.int64)}


def _storable(tensor: Tensor, dtype: str) -> np.ndarray:
    return tensor.detach().to("cpu", getattr(torch, dtype)).numpy()


@dataclass
class HarvestSummary:
    """What a harvest wrote: `load()` reads it back as a `datasets.Dataset`."""

    out: Path
    names: tuple[str, ...]
    rows: int
    context_size: int
    shards: int
    shards_run: int
    seconds: float
    layers_run: int | None
    engine: str
    num_workers: int  # as asked; `workers` ran (no more than the shards to run)

    @property
    def workers(self) -> int:
        return pool_size(self.num_workers, self.shards_run)

    @property
    def tokens(self) -> int:
        return self.rows * self.context_size

    @property
    def tokens_per_second(self) -> float:
        """Tokens harvested by this call (resumed shards excluded) per second of its run."""
        run = self.tokens if self.shards == 0 else self.tokens * self.shards_run / self.shards
        return run / self.seconds if self.seconds > 0 else 0.0

    def load(self):
        return require_datasets().load_from_disk(str(self.out))

    def __str__(self) -> str:
        layers = "all layers" if self.layers_run is None else f"layers 0-{self.layers_run - 1}"
        resumed = self.shards - self.shards_run
        what = (f"{len(self.names)} value(s) over {self.rows} windows x {self.context_size} tokens ({self.tokens} "
                f"tokens, {self.shards} shards{f', {resumed} resumed' if resumed else ''})")
        if self.shards_run == 0:
            return f"the harvest in {self.out} of {what} was already complete: nothing to run"
        workers = f"{self.workers} worker{'s' if self.workers > 1 else ''}"
        if self.workers < self.num_workers:
            workers += (f" (num_workers={self.num_workers}, but {self.shards_run} shard{'s' if self.shards_run > 1 else ''}"
                        " to run: a worker takes a shard at a time)")
        return (f"harvested {what} into {self.out} in {self.seconds:.1f} s: {self.tokens_per_second:,.0f} tokens/s "
                f"({self.engine}, {workers}, {layers} run)")


def _names(model, names) -> tuple[str, ...]:
    """Standard names for the given ones (standard or TransformerLens), each once, in order; each a
    per-position value, as a [context_size, d] column needs."""
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ValueError("names is empty; name at least one value (e.g. 'layers.0.layer_output')")
    resolved = []
    for name in names:
        canonical, _ = model.resolve_hook_name(name)
        point = model.standard_hook_dict[canonical]
        if not isinstance(point, ValueHook) or point.value.seq_axis is None:
            layout = point.value.layout_text if isinstance(point, ValueHook) else "no layout"
            raise ValueError(f"{name!r} ({layout}) has no position axis; a harvest stores per-position values")
        if canonical not in resolved:
            resolved.append(canonical)
    return tuple(resolved)


def _layers_needed(model, names: tuple[str, ...], probe: Int[Tensor, "1 seq"]) -> tuple[int | None, dict[str, Tensor]]:
    """(stop_at_layer, a probe's values): the layers up to the deepest named value's run; a value read
    after the layers (final_norm_output, logits) needs the whole run (None). Decided by a one-row run."""
    deepest = max((int(m.group(1)) + 1 for n in names if (m := re.match(r"layers\.(\d+)\.", n))), default=0)
    values = _activations(model, probe, names, deepest)
    if values is not None:
        return deepest, values
    return None, _activations(model, probe, names, None)


def _features(values: dict[str, Tensor], storage: str, context_size: int):
    datasets = require_datasets()
    columns = {}
    for name, value in values.items():
        dtype = storage if value.is_floating_point() else "int64"
        columns[name] = datasets.Array2D(shape=(context_size, value.shape[-1]), dtype=dtype)
    columns["token_ids"] = datasets.Sequence(datasets.Value("int32"), length=context_size)
    return datasets.Features(columns)


def harvest(
    model,
    dataset,
    names: str | Sequence[str],
    out: str | os.PathLike,
    *,
    context_size: int | None = None,
    batch_size: int = 32,
    dtype=None,
    engine: str = "local",
    num_workers: int = 1,
    resume: bool = True,
    progress: ProgressArg = None,
    shard_size: int | None = None,
    column: str | None = None,
    family: str | None = None,
) -> HarvestSummary:
    """Write the activations of `names` over a corpus to `out`, in SAELens's cached-activations layout.

    model: a checkpoint path, "embedded", a Hub id in the local cache, or (engine "local") a hooked model.
      Workers load their own copy from the path; this process loads one too, to plan. `family` says which
      family "embedded" means ("arcee", the default, or "alpha_er"); a path's family is detected.
    dataset: token ids [n seq] (each row a window), or a `datasets` Dataset / IterableDataset (or the path
      of one saved with save_to_disk) with a token column (`tokens`, `input_ids` or `token_ids`: windows
      of one length) or a text column (`text`: tokenized by the model's tokenizer and packed into windows
      of `context_size` as SAELens packs them, BOS first); `column` picks one. alpha-er's windows must be
      a multiple of mlp_experts long and at most block_size.
    names: values to store, standard or TransformerLens names; each becomes a column named by its
      standard name, [context_size, d] per row (a value with heads is flattened, position first), beside
      `token_ids` (int32).
    dtype: the dtype the model runs in (default: the checkpoint's); activations are stored in it, bfloat16
      as float32 (Arrow has no bfloat16; the widening is exact).
    engine: "local" (this process) or "ray" (an actor pool of `num_workers` replicas on the running Ray
      cluster, or on a local one; one GPU each where the cluster has GPUs; no more replicas than shards to
      run). The output is the same bytes.
    resume: continue the harvest already in `out` (refused if it is another model, config, corpus, names,
      dtype or size); False refuses a non-empty `out`.
    shard_size: rows per shard file, the unit of work a worker takes (default: about 64 MiB of
      activations, whole batches).

    Only the layers up to the deepest named value run. Memory stays one batch of activations per worker,
    whatever the corpus's size. Returns a HarvestSummary; `datasets.load_from_disk(out)` reads the result.
    """
    began = time.perf_counter()
    check_engine(engine, num_workers)
    sizes = {"batch_size": batch_size, **({} if shard_size is None else {"shard_size": shard_size})}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} must be a positive integer")
    out = Path(out)
    check_out(out, resume, leftovers(out) if out.is_dir() else [], MANIFEST, "harvest")
    model, source = resolve_model(model, family, dtype, engine)
    names = _names(model, names)
    corpus = read_corpus(dataset, column)
    windows, context_size = window_batches(corpus, model, context_size)
    run_dtype = next(model.parameters()).dtype
    job = {
        "format": FORMAT,
        "model": model_identity(model),
        "names": list(names),
        "dtype": str(run_dtype).removeprefix("torch."),
        "storage_dtype": STORAGE[run_dtype],
        "context_size": context_size,
        "batch_size": batch_size,
    }
    out.mkdir(parents=True, exist_ok=True)
    with locked(out):
        clear_leftovers(out)
        manifest = Manifest(out)
        existing = manifest.data
        first = next(windows, None)
        if first is None:
            raise ValueError("the dataset gives no window (text shorter than one context_size?)")
        device = next(model.parameters()).device
        stop_at_layer, probe = _layers_needed(model, names, torch.from_numpy(first[:1]).long().to(device))
        features = _features(probe, job["storage_dtype"], context_size)
        row_bytes = sum(int(np.prod(f.shape)) * np.dtype(f.dtype).itemsize for n, f in features.items()
                        if n != "token_ids")
        job["shard_size"] = shard_size or max(1, SHARD_BYTES // (row_bytes * batch_size)) * batch_size
        job["source"] = str(source.source) if source else "a model object"
        if existing:
            refuse_mismatch(existing, job, out)
        digest = corpus.fingerprint()
        job["dataset"] = {"kind": corpus.kind, "column": corpus.column, "fingerprint": digest}
        if existing and existing.get("dataset") != job["dataset"]:
            raise ValueError(f"{out} holds a harvest of another corpus (dataset: {existing.get('dataset')} there, "
                             f"{job['dataset']} now); it is never mixed with this one: harvest into another "
                             "directory, or delete it to start over")
        if not existing:
            manifest.data = {**job, "rows": None, "layers_run": stop_at_layer, "shard_files": SHARD_FILE,
                             "shards": [], "complete": False}
            manifest.save()
        if manifest.data["rows"] is None or (not (out / WINDOWS).exists() and not manifest.data["complete"]):
            rows = stage_windows(itertools.chain([first], windows), model, out / WINDOWS)
            if manifest.data["rows"] not in (None, rows):
                raise RuntimeError(f"the corpus gave {rows} windows, the manifest says {manifest.data['rows']}")
            manifest.data["rows"] = rows
            manifest.save()
        rows = manifest.data["rows"]
        plan = HarvestPlan(str(out), names, stop_at_layer, context_size, batch_size, job["shard_size"], rows,
                           features, torch.get_num_threads())
        todo = [s for s in range(plan.shards) if s not in manifest.done]
        (out / ".tmp").mkdir(exist_ok=True)
        with tracker(progress, total=rows * context_size, desc="harvest", unit="tok", unit_scale=True) as steps:
            steps.advance((rows - sum(_rows(plan, s) for s in todo)) * context_size)  # shards already written
            if todo:
                worker_model = source if engine == "ray" else model
                if engine == "ray":
                    del model  # the workers load their own; this copy planned the run
                for result in run(HarvestWorker, worker_model, plan, [{"shard": s} for s in todo], engine,
                                   num_workers):
                    shard = int(result["shard"])
                    manifest.record(shard, plan)
                    steps.advance(_rows(plan, shard) * context_size)
        finish(out, manifest, plan)
    return HarvestSummary(out, names, rows, context_size, plan.shards, len(todo), time.perf_counter() - began,
                          stop_at_layer, engine, num_workers)


def _rows(plan: HarvestPlan, shard: int) -> int:
    start, stop = plan.shard_rows(shard)
    return stop - start
