"""Corpus-scale runs: activations over a dataset written to disk, and activation patching over a
dataset of prompt pairs, in this process or spread over a Ray cluster.

    from hooked_models import corpus
    corpus.harvest("embedded", "data/text", ["layers.1.layer_output"], "out/acts", context_size=16)
    datasets.load_from_disk("out/acts")                          # SAELens's cached-activations layout
    corpus.harvest("path/to/AFM-4.5B", "data/text", names, "out/acts", context_size=1024,
                   engine="ray", num_workers=8)                 # one replica per GPU, same output
    result = corpus.patch("embedded", pairs, "layer_input", ("layer", "seq"))   # mean over the pairs

One code path whatever the engine: the work is cut into units (a shard of rows to harvest, a chunk of
pairs to patch), and one callable class loads the model once and does a unit per call. The local engine
calls it in this process; the Ray engine gives it to Ray Data's `map_batches` over an actor pool, one
replica per actor (and per GPU where the cluster has GPUs), so Ray schedules, retries the units of a
worker that died, and spreads them over machines. Ray is imported only for `engine="ray"`.

A harvest writes each shard to a temporary name and renames it into place, and the manifest records the
shards done, so a run killed at any point is finished by running it again: no shard missing or written
twice. A shard's rows and batches are fixed by the plan, not by the engine or by which worker ran it,
so the output is the same bytes whichever engine, worker count or interruption produced it.
"""

import fcntl
import hashlib
import itertools
import json
import os
import pickle
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm import tqdm

from hooked_models.dtypes import resolve_dtype
from hooked_models.families import detect_family, family_name, load_model
from hooked_models.hooks import ValueHook
from hooked_models.patching import PatchingResult, activation_patch

ENGINES = ("local", "ray")
# Column names read as token ids or as text when `column` is not given (SAELens's and transformers').
TOKEN_COLUMNS = ("tokens", "input_ids", "token_ids")
TEXT_COLUMNS = ("text",)
# Arrow has no bfloat16: it is stored widened to float32, which is exact.
STORAGE = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64", torch.bfloat16: "float32"}
MANIFEST = "manifest.json"
WINDOWS = "windows.int32"
SHARD_FILE = "data-{shard:05d}.arrow"
FORMAT = "hooked_models.corpus.harvest/1"
# A shard holds about this many bytes of activations (a whole number of batches, at least one).
SHARD_BYTES = 64 * 2**20
# Ray actors reserve part of a CPU: whole CPUs per actor starve the read stage on a small machine.
ACTOR_CPUS = 0.5


# ------------------------------------------------------------------------------------------ models
def _family(family: str | None, source) -> str:
    return detect_family(source) if family is None else family_name(family)


@dataclass(frozen=True)
class ModelSource:
    """Where a worker loads its replica from: a checkpoint path, "embedded" or a cached Hub id."""

    source: str
    family: str
    dtype: torch.dtype | None = None

    def load(self, device=None):
        return load_model(self.source, self.family, self.dtype, device)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _model_source(model, family, dtype) -> ModelSource:
    """Where workers load the model from; a model object has no path to load from."""
    from hooked_models.model import HookedModel

    if isinstance(model, HookedModel):
        raise ValueError("engine='ray' loads the model in each worker from a path; pass the checkpoint "
                         "path (model.save_pretrained(dir) writes one), or use engine='local'")
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a checkpoint path, 'embedded', a Hub id or a hooked model, "
                         f"not {type(model).__name__}")
    return ModelSource(str(model), _family(family, model), resolve_dtype(dtype))


def _resolve_model(model, family, dtype, engine: str):
    """(the model, its source for workers or None for an object)."""
    from hooked_models.model import HookedModel

    if isinstance(model, HookedModel) and engine == "local":
        if dtype is not None and resolve_dtype(dtype) != next(model.parameters()).dtype:
            raise ValueError(f"dtype={dtype} differs from the model's {next(model.parameters()).dtype}; "
                             "dtype applies when the model is loaded from a path")
        return model, None
    source = _model_source(model, family, dtype)
    # This process loads it too: to plan (shapes, tokenizer, fingerprint), and to run it for engine="local".
    return source.load(_default_device() if engine == "local" else "cpu"), source


def model_identity(model) -> dict:
    """What makes two models the same for a harvest: family, config fields and a weights fingerprint
    (every tensor's name, shape, dtype and up to 1024 evenly spaced elements)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        spaced = torch.linspace(0, flat.numel() - 1, min(1024, flat.numel()), dtype=torch.float64).long()
        sample = flat[spaced.to(flat.device)]
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return {"family": type(model).__name__, "config": _jsonable(model.cfg), "weights": digest.hexdigest()}


def _jsonable(value):
    if is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in fields(value) if f.name not in ("device", "dtype")}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


# ----------------------------------------------------------------------------------------- engines
def _check_engine(engine: str, num_workers: int) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} must be one of {', '.join(ENGINES)}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} must be a positive integer")
    if engine == "local" and num_workers != 1:
        raise ValueError(f"engine='local' runs one worker in this process; num_workers={num_workers} "
                         "needs engine='ray'")


def _run(worker_cls, model, plan, items: list[dict], engine: str, num_workers: int) -> Iterator[dict]:
    """Each item through `worker_cls(model, plan)`, one item per call; yields each call's output row
    as it completes (in any order under Ray)."""
    if engine == "local":
        worker = worker_cls(model, plan)
        for item in items:
            yield _first_row(worker({k: np.asarray([v]) for k, v in item.items()}))
        return
    with _ray_cluster() as ray:
        context = ray.data.DataContext.get_current()
        bars, context.enable_progress_bars = context.enable_progress_bars, False
        try:
            resources = {"num_gpus": 1} if ray.cluster_resources().get("GPU", 0) > 0 else {}
            units = ray.data.from_items(items, override_num_blocks=min(len(items), 10000))
            results = units.map_batches(
                worker_cls, fn_constructor_kwargs={"model": model, "plan": plan}, batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=num_workers), num_cpus=ACTOR_CPUS, **resources)
            yield from results.iter_rows()
        finally:
            context.enable_progress_bars = bars


def _first_row(batch: dict) -> dict:
    return {k: v[0] for k, v in batch.items()}


@contextmanager
def _ray_cluster():
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


class _Worker:
    """Loads its replica once (or takes the model object, locally) and computes with the driver's
    torch thread count, so a worker's arithmetic is the local run's."""

    def __init__(self, model, plan):
        torch.set_num_threads(plan.threads)
        self.plan = plan
        self.model = model.load(_worker_device()) if isinstance(model, ModelSource) else model


# ------------------------------------------------------------------------------------------ inputs
def _datasets():
    """The `datasets` library (the corpus extra), imported when a corpus run needs it."""
    try:
        import datasets
        import datasets.arrow_writer  # noqa: F401
    except ImportError:
        raise ImportError("corpus runs need the datasets library: pip install 'hooked_models[corpus]'") from None
    return datasets


def _column(names: Sequence[str], column: str | None, what: str) -> str:
    if column is not None:
        if column not in names:
            raise ValueError(f"{what} has no column {column!r}; it has {', '.join(names)}")
        return column
    found = [c for c in (*TOKEN_COLUMNS, *TEXT_COLUMNS) if c in names]
    if not found:
        raise ValueError(f"{what} has no column named {' or '.join(TOKEN_COLUMNS + TEXT_COLUMNS)} "
                         f"(it has {', '.join(names)}); say which with column=")
    return found[0]


def _open_dataset(dataset):
    """A `datasets` dataset from a dataset object or the path of one saved with save_to_disk."""
    datasets = _datasets()

    if isinstance(dataset, (str, os.PathLike)):
        if not Path(dataset).is_dir():
            raise ValueError(f"dataset path {str(dataset)!r} is not a directory saved by datasets' save_to_disk")
        dataset = datasets.load_from_disk(str(dataset))
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise ValueError(f"dataset is a DatasetDict with splits {list(dataset)}; pass one split, e.g. dataset['train']")
    if not isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        raise ValueError("dataset must be token ids [n seq], a datasets.Dataset or IterableDataset, or the path "
                         f"of one saved on disk, not {type(dataset).__name__}")
    return dataset


@dataclass
class _Source:
    """The corpus as batches of rows: token windows ("tokens") or documents ("text"), and a digest of
    the raw rows so a resumed harvest can tell it is given the same corpus."""

    kind: str
    column: str | None
    batches: Callable[[], Iterator]

    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"{self.kind} {self.column}".encode())
        for batch in self.batches():
            _digest_rows(digest, batch)
        return digest.hexdigest()


def _digest_rows(digest, batch) -> None:
    if isinstance(batch, np.ndarray):
        digest.update(f"{batch.shape}".encode())
        digest.update(np.ascontiguousarray(batch, dtype=np.int64).tobytes())
    else:
        for text in batch:
            encoded = text.encode()
            digest.update(len(encoded).to_bytes(8, "little") + encoded)


def _source(dataset, column: str | None, rows: int = 1024) -> _Source:
    if isinstance(dataset, (Tensor, np.ndarray)):
        array = dataset.cpu().numpy() if isinstance(dataset, Tensor) else dataset
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"token ids must be an integer array [n seq], got shape {tuple(array.shape)} "
                             f"{array.dtype}")
        return _Source("tokens", None, lambda: (array[i:i + rows] for i in range(0, len(array), rows)))
    dataset = _open_dataset(dataset)
    names = list(dataset.column_names or next(iter(dataset)).keys())
    column = _column(names, column, "the dataset")
    feature = (dataset.features or {}).get(column)
    if feature is None:  # a streaming dataset may not know its features: look at a row
        kind = "text" if isinstance(next(iter(dataset))[column], str) else "tokens"
    else:
        kind = "text" if getattr(feature, "dtype", None) in ("string", "large_string") else "tokens"

    def batches():
        # Token windows come as numpy arrays (a list of lists per batch would cost a Python int per token).
        selected = dataset.select_columns([column])
        for batch in (selected if kind == "text" else selected.with_format("numpy")).iter(batch_size=rows):
            values = batch[column]
            if kind == "text":
                if values and not isinstance(values[0], str):
                    raise ValueError(f"column {column!r} holds {type(values[0]).__name__}, not text")
                yield values
                continue
            try:
                array = np.asarray(values.tolist() if values.dtype == object else values, dtype=np.int64)
            except (ValueError, TypeError):
                raise ValueError(f"the rows of token column {column!r} differ in length; give token windows "
                                 "of one length, or documents as a text column to be packed") from None
            if array.ndim != 2:
                raise ValueError(f"token column {column!r} must hold one list of ids per row, got shape "
                                 f"{array.shape}")
            yield array

    return _Source(kind, column, batches)


def pack(documents: Iterable[Sequence[int]], context_size: int, bos: int | None) -> Iterator[list[int]]:
    """Documents' token ids -> windows of `context_size`, as SAELens packs them by default
    (`concat_and_batch_sequences` with BOS as the first token and the separator): each window starts
    with BOS, a document that starts inside a window is preceded by BOS, and the last partial window
    is dropped. A document or window that already starts with BOS gets no second one."""
    window: list[int] = []
    for doc in documents:
        offset = 0
        while offset < len(doc):
            if not window:
                if bos is not None and doc[offset] != bos:
                    window.append(bos)
            elif bos is not None and offset == 0 and doc[0] != bos:
                window.append(bos)
            take = context_size - len(window)
            window.extend(doc[offset:offset + take])
            offset += take
            if len(window) == context_size:
                yield window
                window = []


def _window_batches(source: _Source, model, context_size: int | None) -> tuple[Iterator[np.ndarray], int]:
    """Batches of token windows [rows context_size] and the context size, checked against the model."""
    if source.kind == "tokens":
        first = next(source.batches(), None)
        if first is None or len(first) == 0:
            raise ValueError("the dataset has no rows")
        width = first.shape[1]
        if context_size is not None and context_size != width:
            raise ValueError(f"context_size={context_size}, but the token windows are {width} tokens long; "
                             "give windows of that length or documents as a text column to be packed")
        context_size = width
        batches = source.batches()
    else:
        if context_size is None:
            raise ValueError(f"context_size is needed to pack text into windows (the model takes at most "
                             f"{model.max_positions} positions)")
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ValueError(f"the model has no tokenizer to tokenize text column {source.column!r}; "
                             "give token ids instead")
        bos = getattr(tokenizer, "bos_token_id", None)

        def documents():
            for texts in source.batches():
                yield from tokenizer(list(texts), add_special_tokens=False)["input_ids"]

        def batches():
            windows = []
            for window in pack(documents(), context_size, bos):
                windows.append(window)
                if len(windows) == 1024:
                    yield np.asarray(windows, dtype=np.int64)
                    windows = []
            if windows:
                yield np.asarray(windows, dtype=np.int64)

        batches = batches()
    _check_context(model, context_size)
    return batches, context_size


def _check_context(model, context_size: int) -> None:
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise ValueError(f"context_size={context_size!r} must be a positive integer")
    try:
        model._check_sequence(context_size, None)
    except ValueError as error:
        raise ValueError(f"context_size={context_size}: {error}") from None


def _stage_windows(batches: Iterator[np.ndarray], model, path: Path) -> int:
    """Write the windows as int32 rows to `path` (renamed into place when whole); returns their count."""
    rows, vocab = 0, model.cfg.vocab_size
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        for batch in batches:
            if batch.size and (batch.min() < 0 or batch.max() >= vocab):
                bad = int(batch.min()) if batch.min() < 0 else int(batch.max())
                raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
            f.write(np.ascontiguousarray(batch, dtype=np.int32).tobytes())
            rows += len(batch)
    if rows == 0:
        raise ValueError("the dataset gives no window (text shorter than one context_size?)")
    os.replace(partial, path)
    return rows


def read_windows(path: Path, start: int, stop: int, context_size: int) -> np.ndarray:
    """Rows [start, stop) of a staged windows file, read (not memory-mapped: memory stays one shard)."""
    with open(path, "rb") as f:
        f.seek(start * context_size * 4)
        return np.fromfile(f, dtype=np.int32, count=(stop - start) * context_size).reshape(-1, context_size)


# ----------------------------------------------------------------------------------------- harvest
@dataclass(frozen=True)
class HarvestPlan:
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

    def shard_rows(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_size, min((shard + 1) * self.shard_size, self.rows)

    @property
    def shards(self) -> int:
        return -(-self.rows // self.shard_size)


def shard_file(shard: int) -> str:
    return SHARD_FILE.format(shard=shard)


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


class HarvestWorker(_Worker):
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
            writer = _datasets().arrow_writer.ArrowWriter(features=plan.features, path=str(temporary))
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
    num_workers: int

    @property
    def tokens(self) -> int:
        return self.rows * self.context_size

    @property
    def tokens_per_second(self) -> float:
        """Tokens harvested by this call (resumed shards excluded) per second of its run."""
        run = self.tokens if self.shards == 0 else self.tokens * self.shards_run / self.shards
        return run / self.seconds if self.seconds > 0 else 0.0

    def load(self):
        return _datasets().load_from_disk(str(self.out))

    def __str__(self) -> str:
        layers = "all layers" if self.layers_run is None else f"layers 0-{self.layers_run - 1}"
        resumed = self.shards - self.shards_run
        what = (f"{len(self.names)} value(s) over {self.rows} windows x {self.context_size} tokens ({self.tokens} "
                f"tokens, {self.shards} shards{f', {resumed} resumed' if resumed else ''})")
        if self.shards_run == 0:
            return f"the harvest in {self.out} of {what} was already complete: nothing to run"
        return (f"harvested {what} into {self.out} in {self.seconds:.1f} s: {self.tokens_per_second:,.0f} tokens/s "
                f"({self.engine}, {self.num_workers} worker{'s' if self.num_workers > 1 else ''}, {layers} run)")


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
    datasets = _datasets()
    columns = {}
    for name, value in values.items():
        dtype = storage if value.is_floating_point() else "int64"
        columns[name] = datasets.Array2D(shape=(context_size, value.shape[-1]), dtype=dtype)
    columns["token_ids"] = datasets.Sequence(datasets.Value("int32"), length=context_size)
    return datasets.Features(columns)


class _Manifest:
    """out/manifest.json: the harvest's identity (model, corpus, names, dtype, sizes) and the shards done,
    rewritten whole (temporary name, then renamed) after each change.

    The shards done are kept as runs of consecutive shards with their rows (`{"shards": [0, 40], "rows":
    [0, 2560]}`: shards 0-39 hold rows 0-2559, in files data-00000.arrow ...), so the manifest stays a few
    lines however many shards a corpus has (workers finish them nearly in order)."""

    def __init__(self, out: Path):
        self.path = out / MANIFEST
        self.data: dict = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.runs = [run["shards"] for run in self.data.get("shards", [])]
        self.done = {shard for a, b in self.runs for shard in range(a, b)}

    def record(self, shard: int, plan: "HarvestPlan") -> None:
        self.done.add(shard)
        merged: list[list[int]] = []
        for a, b in sorted([*self.runs, [shard, shard + 1]]):  # a few runs: as many as workers, roughly
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.runs = merged
        self.data["shards"] = [{"shards": [a, b], "rows": [plan.shard_rows(a)[0], plan.shard_rows(b - 1)[1]]}
                               for a, b in merged]
        self.save()

    def save(self) -> None:
        partial = self.path.with_name(f".{MANIFEST}.{uuid.uuid4().hex}")
        partial.write_text(json.dumps(self.data, indent=1))
        os.replace(partial, self.path)


# The fields of a manifest that must match for a harvest to continue it.
IDENTITY = ("format", "names", "dtype", "storage_dtype", "context_size", "batch_size", "shard_size", "model",
            "dataset")


def _refuse_mismatch(existing: dict, job: dict, out: Path) -> None:
    for key in IDENTITY:
        if key == "dataset":
            continue  # compared once the corpus is read
        if existing.get(key) != job.get(key):
            if key == "model":
                which = [k for k in job["model"] if existing.get("model", {}).get(k) != job["model"][k]]
                detail = f"its {' and '.join(which)} differ"
            else:
                detail = f"{existing.get(key)!r} there, {job.get(key)!r} now"
            raise ValueError(f"{out} holds a harvest of another job ({key}: {detail}); it is never mixed with "
                             "this one: harvest into another directory, or delete it to start over")


def _leftovers(out: Path) -> list[Path]:
    """What a killed harvest can leave besides its results: the lock file, the staging directory of
    partial shards, and the temporary files that manifest, windows and state are written to before
    they are renamed into place."""
    return [p for p in out.iterdir()
            if p.name in (".lock", ".tmp") or p.name.startswith(f".{MANIFEST}.") or p.name.endswith(".partial")]


def _clear_leftovers(out: Path) -> None:
    """Delete a killed harvest's temporaries (the lock held, so no other harvest is writing them)."""
    for path in _leftovers(out):
        if path.name == ".tmp":
            shutil.rmtree(path, ignore_errors=True)
        elif path.name != ".lock":
            path.unlink(missing_ok=True)


@contextmanager
def _locked(out: Path):
    """One harvest at a time per directory (a killed one leaves no lock: the kernel drops it)."""
    with open(out / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another harvest is writing to {out}") from None
        yield


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
    progress: bool | None = None,
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
      cluster, or on a local one; one GPU each where the cluster has GPUs). The output is the same bytes.
    resume: continue the harvest already in `out` (refused if it is another model, config, corpus, names,
      dtype or size); False refuses a non-empty `out`.
    shard_size: rows per shard file, the unit of work a worker takes (default: about 64 MiB of
      activations, whole batches).

    Only the layers up to the deepest named value run. Memory stays one batch of activations per worker,
    whatever the corpus's size. Returns a HarvestSummary; `datasets.load_from_disk(out)` reads the result.
    """
    began = time.perf_counter()
    _check_engine(engine, num_workers)
    sizes = {"batch_size": batch_size, **({} if shard_size is None else {"shard_size": shard_size})}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} must be a positive integer")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file, not a directory")
    if out.is_dir() and set(out.iterdir()) - set(_leftovers(out)):
        if not resume:
            raise ValueError(f"out={str(out)!r} is not empty; pass resume=True to continue the harvest there, "
                             "or give an empty directory")
        if not (out / MANIFEST).exists():
            raise ValueError(f"out={str(out)!r} is not empty and holds no harvest ({MANIFEST}); "
                             "give an empty directory")
    model, source = _resolve_model(model, family, dtype, engine)
    names = _names(model, names)
    corpus = _source(dataset, column)
    windows, context_size = _window_batches(corpus, model, context_size)
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
    with _locked(out):
        _clear_leftovers(out)
        manifest = _Manifest(out)
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
            _refuse_mismatch(existing, job, out)
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
            rows = _stage_windows(itertools.chain([first], windows), model, out / WINDOWS)
            if manifest.data["rows"] not in (None, rows):
                raise RuntimeError(f"the corpus gave {rows} windows, the manifest says {manifest.data['rows']}")
            manifest.data["rows"] = rows
            manifest.save()
        rows = manifest.data["rows"]
        plan = HarvestPlan(str(out), names, stop_at_layer, context_size, batch_size, job["shard_size"], rows,
                           features, torch.get_num_threads())
        todo = [s for s in range(plan.shards) if s not in manifest.done]
        (out / ".tmp").mkdir(exist_ok=True)
        show = sys.stderr.isatty() if progress is None else progress
        with tqdm(total=rows * context_size, initial=(rows - sum(_rows(plan, s) for s in todo)) * context_size,
                  unit="tok", unit_scale=True, desc="harvest", disable=not show) as bar:
            if todo:
                worker_model = source if engine == "ray" else model
                if engine == "ray":
                    del model  # the workers load their own; this copy planned the run
                for result in _run(HarvestWorker, worker_model, plan, [{"shard": s} for s in todo], engine,
                                   num_workers):
                    shard = int(result["shard"])
                    manifest.record(shard, plan)
                    bar.update(_rows(plan, shard) * context_size)
        _finish(out, manifest, plan)
    return HarvestSummary(out, names, rows, context_size, plan.shards, len(todo), time.perf_counter() - began,
                          stop_at_layer, engine, num_workers)


def _rows(plan: HarvestPlan, shard: int) -> int:
    start, stop = plan.shard_rows(shard)
    return stop - start


def _finish(out: Path, manifest: _Manifest, plan: HarvestPlan) -> None:
    """Write `datasets`' dataset_info.json and state.json over the shards, in order, and drop the staging."""
    datasets = _datasets()
    missing = [s for s in range(plan.shards) if s not in manifest.done or not (out / shard_file(s)).exists()]
    if missing:
        raise RuntimeError(f"shards {missing[:10]} of {out} are missing after the run")
    datasets.DatasetInfo(features=plan.features).write_to_directory(str(out))
    files = [shard_file(s) for s in range(plan.shards)]
    state = {"_data_files": [{"filename": f} for f in files],
             # A fingerprint from the content's identity, so the same harvest gives the same bytes.
             "_fingerprint": hashlib.sha256(json.dumps([manifest.data[k] for k in IDENTITY]).encode()).hexdigest()[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    partial = out / ".state.json.partial"
    partial.write_text(json.dumps(state, indent=2, sort_keys=True))
    os.replace(partial, out / "state.json")
    manifest.data["complete"] = True
    manifest.save()
    (out / WINDOWS).unlink(missing_ok=True)
    shutil.rmtree(out / ".tmp", ignore_errors=True)


# ------------------------------------------------------------------------------------------- patch
PAIR_COLUMNS = ("clean", "corrupted")


def logit_diff(logits: Float[Tensor, "batch seq vocab_size"], rows: dict[str, Tensor]) -> Float[Tensor, " batch"]:
    """Each pair's logit(answer) − logit(wrong) at its `position` (a column, default the last), in float32:
    the per-pair terms whose mean is `patching.logit_diff_metric`."""
    batch = torch.arange(logits.shape[0], device=logits.device)
    position = rows.get("position")
    position = torch.full_like(batch, -1) if position is None else position.to(logits.device)
    last = logits[batch, position].float()
    return last[batch, rows["answer"].to(logits.device)] - last[batch, rows["wrong"].to(logits.device)]


METRICS = {"logit_diff": (logit_diff, ("answer", "wrong"))}


@dataclass
class CorpusPatchingResult(PatchingResult):
    """A `PatchingResult` whose values are means over `pairs` prompt pairs (`tokens`: their prompt
    tokens); with `per_pair`, also each pair's values [pairs *grid] and clean and corrupted metrics."""

    pairs: int = 0
    tokens: int = 0
    pair_values: Tensor | None = None
    pair_clean_metric: Tensor | None = None
    pair_corrupted_metric: Tensor | None = None


@dataclass(frozen=True)
class PatchPlan:
    """What every worker needs to patch a chunk of pairs (sent to Ray actors)."""

    value: str
    over: tuple[str, ...] | None
    metric: Callable
    per_pair: bool
    options: dict
    threads: int


class PatchWorker(_Worker):
    """One chunk of pairs per call: `activation_patch` on the chunk with the mean of the per-pair metric
    (or on each pair alone, for per-pair values). Returns the chunk's results, pickled."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        plan = self.plan
        results = []
        for i, chunk in enumerate(batch["chunk"].tolist()):
            rows = {k: torch.from_numpy(np.array(v[i])) for k, v in batch.items() if k != "chunk"}
            groups = ([{k: v[j:j + 1] for k, v in rows.items()} for j in range(len(rows["clean"]))]
                      if plan.per_pair else [rows])
            done = [self._patch(group) for group in groups]
            results.append(pickle.dumps({"chunk": chunk, "pairs": len(rows["clean"]), "results": done}))
        return {"result": np.asarray(results, dtype=object)}

    def _patch(self, rows: dict[str, Tensor]) -> dict:
        plan, pairs = self.plan, len(rows["clean"])

        def metric(logits):
            values = torch.as_tensor(plan.metric(logits, rows))
            if values.shape != (pairs,):
                raise ValueError(f"the metric must return one value per pair, shape ({pairs},); "
                                 f"got {tuple(values.shape)}")
            return values.mean()

        result = activation_patch(self.model, rows["clean"], rows["corrupted"], metric, plan.value, plan.over,
                                  progress=False, **plan.options)
        return {"pairs": pairs, "values": result.values, "clean": result.clean_metric,
                "corrupted": result.corrupted_metric,
                "grid": (result.axes, result.labels, result.value, result.direction)}


def _pair_columns(pairs, needed: Sequence[str]) -> dict[str, Tensor]:
    """The pairs' columns as tensors of one length: clean and corrupted [pairs seq], the rest [pairs ...]."""
    if isinstance(pairs, dict):
        columns = dict(pairs)
    else:
        dataset = _open_dataset(pairs)
        columns = {name: dataset[name] for name in dataset.column_names}
    missing = [c for c in (*PAIR_COLUMNS, *needed) if c not in columns]
    if missing:
        raise ValueError(f"pairs need the columns {', '.join((*PAIR_COLUMNS, *needed))}; {', '.join(missing)} "
                         f"missing (they have {', '.join(columns)})")
    tensors = {}
    for name, values in columns.items():
        try:
            tensors[name] = torch.as_tensor(np.asarray(values)) if not isinstance(values, Tensor) else values.cpu()
        except (ValueError, TypeError):
            if name in PAIR_COLUMNS:
                raise ValueError(f"the {name} prompts differ in length; every pair must have one length (pad "
                                 "them), as a patch moves an activation between aligned positions") from None
            continue  # a column the metric does not read (text, say)
    lengths = {name: len(t) for name, t in tensors.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"the pairs' columns differ in length: {lengths}")
    for name in PAIR_COLUMNS:
        if tensors[name].ndim != 2 or tensors[name].is_floating_point():
            raise ValueError(f"column {name!r} must hold token ids [pairs seq], got {tuple(tensors[name].shape)} "
                             f"{tensors[name].dtype}")
    if tensors["clean"].shape != tensors["corrupted"].shape:
        raise ValueError(f"clean {tuple(tensors['clean'].shape)} and corrupted {tuple(tensors['corrupted'].shape)} "
                         "must have one shape")
    if len(tensors["clean"]) == 0:
        raise ValueError("pairs is empty")
    return tensors


def patch(
    model,
    pairs,
    value: str = "layer_input",
    over: Sequence[str] | None = None,
    *,
    metric: str | Callable = "logit_diff",
    engine: str = "local",
    num_workers: int = 1,
    chunk_size: int = 64,
    per_pair: bool = False,
    progress: bool | None = None,
    family: str | None = None,
    dtype=None,
    **options,
) -> CorpusPatchingResult:
    """`patching.activation_patch` over a dataset of prompt pairs, in chunks: the mean over the pairs.

    pairs: a `datasets.Dataset` (or the path of one saved on disk), or a dict of equal-length columns:
      `clean` and `corrupted` token ids [pairs seq] of one length, and the metric's per-pair arguments
      (`answer` and `wrong` for "logit_diff", and optionally `position`, default the last).
    metric: "logit_diff", or `metric(logits, rows) -> [pairs]`, one value per pair given the chunk's rows
      (a dict of the chunk's columns as tensors); a chunk's patch is scored by the mean over its pairs.
    value, over, and `options` (direction, select, batch_size, memory_budget, position_labels): as
      `activation_patch`. engine, num_workers, model, family, dtype: as `harvest`.
    per_pair: also return each pair's values (each pair is then patched on its own).

    Returns a CorpusPatchingResult: each cell is the mean over the pairs of that patch's metric, the
    same as `activation_patch` on all the pairs at once up to float32 summation order (each chunk's
    mean is weighted by its size; the combination is in float64).
    """
    _check_engine(engine, num_workers)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")
    if isinstance(metric, str):
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r} must be one of {', '.join(METRICS)} or a function "
                             "metric(logits, rows) -> [pairs]")
        metric, needed = METRICS[metric]
    elif callable(metric):
        needed = ()
    else:
        raise ValueError(f"metric must be a name or a function, not {type(metric).__name__}")
    columns = _pair_columns(pairs, needed)
    total, seq = columns["clean"].shape
    # Ray's workers load from the path (the driver needs no copy); locally this process runs the model.
    if engine == "ray":
        worker_model = _model_source(model, family, dtype)
    else:
        worker_model, _ = _resolve_model(model, family, dtype, engine)
    plan = PatchPlan(value, None if over is None else tuple(over), metric, per_pair, options, torch.get_num_threads())
    items = [{"chunk": c, **{k: v[start:start + chunk_size].numpy() for k, v in columns.items()}}
             for c, start in enumerate(range(0, total, chunk_size))]
    show = sys.stderr.isatty() if progress is None else progress
    chunks = {}
    with tqdm(total=total * seq, unit="tok", unit_scale=True, desc=f"patch {value}", disable=not show) as bar:
        for row in _run(PatchWorker, worker_model, plan, items, engine, num_workers):
            done = pickle.loads(row["result"])
            chunks[done["chunk"]] = done
            bar.update(done["pairs"] * seq)
    result = _combine([chunks[c] for c in range(len(items))], total, per_pair)
    result.tokens = total * seq
    return result


def _combine(chunks: list[dict], total: int, per_pair: bool) -> CorpusPatchingResult:
    """The mean over pairs of the chunks' results, each weighted by its pairs, summed in float64 in chunk
    order (so the engine and the order chunks finish in change no bit)."""
    parts = [part for chunk in chunks for part in chunk["results"]]
    grid = parts[0]["grid"]
    if any(part["grid"] != grid for part in parts):
        raise ValueError("the chunks' sweeps differ (axes or labels); every pair must have one length")
    values = sum(part["pairs"] * part["values"].double() for part in parts) / total
    clean = sum(part["pairs"] * part["clean"] for part in parts) / total
    corrupted = sum(part["pairs"] * part["corrupted"] for part in parts) / total
    axes, labels, value, direction = grid
    result = CorpusPatchingResult(values=values.float(), axes=axes, labels=labels, value=value, direction=direction,
                                  clean_metric=clean, corrupted_metric=corrupted, pairs=total)
    if per_pair:
        result.pair_values = torch.stack([part["values"] for part in parts])
        result.pair_clean_metric = torch.tensor([part["clean"] for part in parts])
        result.pair_corrupted_metric = torch.tensor([part["corrupted"] for part in parts])
    return result
