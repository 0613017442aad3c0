"""`statistics`: every feature's statistics in one pass over a corpus, locally or over Ray.

    stats = features.statistics("out/acts", transcoders, model=model)          # a harvest on disk
    stats = features.statistics(model, sae, dataset="data/text", context_size=16)  # through the model
    stats = features.statistics(..., engine="ray", num_workers=8)              # the same bits
    stats[1].top_windows(37); stats[1].interval_windows(37); stats[1].histogram(37)

The corpus is cut into shards of rows; a worker turns a shard into a `Partial` per layer, a batch at a time
(the SAE applied to one batch of activations, never to the corpus), and the driver merges the shards'
partials with `partial.merge`, the one reducer, whatever engine ran them. Memory is one batch of
activations plus O(features × k) per layer, however long the corpus. With `out=`, each merged shard is
checkpointed (written under a temporary name, renamed into place), so a run killed or cancelled at any
point is finished by running it again, with the uninterrupted run's result bit for bit; the result is
saved there when whole. Ray is imported only for engine="ray".
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load as load_bytes
from safetensors import safe_open
from safetensors.torch import save, save_file

from hooked_models.corpus.engines import Shards, Worker, check_engine, run
from hooked_models.features.partial import Limits, Partial, merge, merge_all, of_batch
from hooked_models.features.reading import d_sae_of, open_harvest
from hooked_models.features.results import META, FeatureStatistics, LayerStatistics
from hooked_models.progress import ProgressArg, tracker
from hooked_models.sae_metadata import sae_hook_name

CHECKPOINT = "checkpoint.safetensors"
# Batch partials merged at once in a worker (the result is the same for any number: the merge is exact).
MERGE_EVERY = 8
# Logits per feature in the result (circuit-tracer's viewer shows about ten of each).
N_LOGITS = 10


@dataclass(frozen=True)
class Encoder:
    """One layer's features: the value it reads and how (an SAE's `encode`, or a set's `encode(layer, x)`)."""

    name: str
    layer: int | None
    transcoder_id: str


def _is_set(saes) -> bool:
    """A per-layer transcoder set or a cross-layer transcoder (encode(layer, x), input_hook(layer))."""
    return callable(getattr(saes, "input_hook", None)) and hasattr(saes, "n_layers")


def encoders(model, saes, name: str | None = None) -> list[Encoder]:
    """The layers `saes` has features in, each with the value it reads in its standard spelling."""
    if _is_set(saes):
        return [Encoder(saes.input_hook(l), l, f"layer_{l}") for l in range(saes.n_layers)]
    wanted = name or sae_hook_name(saes)
    if wanted is None:
        raise ValueError("the SAE names no hook (no cfg.metadata.hook_name or hook_name): pass name=")
    if model is not None and wanted in model.hook_dict:
        wanted = model.resolve_hook_name(wanted)[0]
    layer = getattr(saes, "layer", None)
    return [Encoder(wanted, layer if isinstance(layer, int) else None, wanted)]


def _encode(saes, encoder: Encoder, x: torch.Tensor) -> torch.Tensor:
    weight = next(saes.parameters())
    x = x.to(weight.device, weight.dtype)
    return (saes.encode(encoder.layer, x) if _is_set(saes) else saes.encode(x)).float()


def _d_sae(saes) -> int:
    return int(saes.d_transcoder) if _is_set(saes) else d_sae_of(saes)


def _directions(saes, layer: int | None) -> torch.Tensor:
    """What a feature writes to the residual stream: its decoder (a cross-layer transcoder's, summed
    over the layers it writes, each of whose MLP outputs adds to the stream)."""
    if not _is_set(saes):
        return saes.W_dec
    return sum(saes.decoder(layer, t) for t in range(layer, saes.n_layers) if _writes(saes, layer, t))


def _writes(saes, source: int, target: int) -> bool:
    return source == target or getattr(saes, "model_kind", "") == "cross_layer_transcoder"


@dataclass(frozen=True)
class StatisticsPlan(Shards):
    """What every worker needs: where the rows come from (a harvest, or token windows through the model),
    the encoders and their limits, and how rows are batched and sharded."""

    harvest: str | None
    windows: np.ndarray | None
    encoders: tuple[Encoder, ...]
    limits: Limits
    saes: nn.Module
    batch_size: int
    shard_size: int
    rows: int
    context_size: int
    threads: int


class StatisticsWorker(Worker):
    """One shard per call: its rows a batch at a time, each layer's features into that layer's partial;
    returns the partials serialised. `on_batch(tokens)` (local runs) reports each batch."""

    on_batch = None
    _view = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        shards, blobs = [], []
        for shard in batch["shard"].tolist():
            tensors = {}
            for i, part in enumerate(self.partials(shard)):
                tensors.update(part.tensors(f"{i}."))
            shards.append(shard)
            blobs.append(save(tensors))
        return {"shard": np.asarray(shards, dtype=np.int64), "partial": np.asarray(blobs, dtype=object)}

    def partials(self, shard: int) -> list[Partial]:
        """One shard's partial per encoder (a local run merges these as they are, unserialised)."""
        plan = self.plan
        names = sorted({e.name for e in plan.encoders})
        if plan.harvest is not None and self._view is None:  # opened once per worker, not once per shard
            self._view = open_harvest(plan.harvest).with_format("torch", columns=[*names, "token_ids"])
        start, stop = plan.shard_rows(shard)
        partials = [[Partial.empty(plan.limits)] for _ in plan.encoders]
        for first in range(start, stop, plan.batch_size):
            last = min(first + plan.batch_size, stop)
            ids, values = self._rows(self._view, names, first, last)
            with torch.no_grad():
                for i, encoder in enumerate(plan.encoders):
                    acts = _encode(plan.saes, encoder, values[encoder.name])
                    partials[i].append(of_batch(acts, ids, first, plan.limits))
                    if len(partials[i]) == MERGE_EVERY:  # merged a few batches at a time: fewer sorts
                        partials[i] = [merge_all(partials[i])]
            if self.on_batch is not None:
                self.on_batch((last - first) * plan.context_size)
        return [merge_all(parts) for parts in partials]

    def _rows(self, view, names, first, last):
        if view is not None:
            rows = view[first:last]
            return rows["token_ids"], {n: rows[n] for n in names}
        tokens = torch.from_numpy(self.plan.windows[first:last]).long()
        device = next(self.model.parameters()).device
        with torch.no_grad():
            _, cache = self.model.run_with_cache(tokens.to(device), names_filter=names, return_cache_object=False)
        return tokens, {n: cache[n].reshape(*tokens.shape, -1) for n in names}


def _fingerprint(saes) -> str:
    digest = hashlib.sha256()
    for name, tensor in saes.state_dict().items():
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _check_harvest(path, model, saes, encs: list[Encoder]):
    harvest = open_harvest(path)
    columns = [c for c in harvest.column_names if c != "token_ids"]
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    if not manifest.get("complete"):
        raise ValueError(f"the harvest in {path} is not complete: rerun corpus.harvest to finish it")
    for e in encs:
        if e.name not in columns:
            raise ValueError(f"the harvest in {path} has no column {e.name!r}, the value {type(saes).__name__} "
                             f"reads{'' if e.layer is None else f' at layer {e.layer}'}; it holds {columns}")
        width = harvest.features[e.name].shape[-1]
        d_in = _d_in(saes)
        if d_in is not None and width != d_in:
            raise ValueError(f"{type(saes).__name__} reads {d_in}-wide inputs; the harvest's column {e.name!r} "
                             f"is {width} wide")
    return harvest, manifest


def _d_in(saes) -> int | None:
    if _is_set(saes):
        return int(saes.d_in)
    w = getattr(saes, "W_enc", None)
    return None if w is None else int(w.shape[0])


def _windows(model, dataset, context_size, column):
    from hooked_models.corpus.data import read_corpus, window_batches

    batches, context_size = window_batches(read_corpus(dataset, column), model, context_size)
    parts = list(batches)
    windows = np.concatenate(parts) if parts else np.zeros((0, context_size or 0), dtype=np.int64)
    if len(windows) == 0:
        raise ValueError("the corpus is empty: the dataset gives no window (text shorter than one context_size?)")
    if windows.min() < 0 or windows.max() >= model.cfg.vocab_size:
        raise ValueError(f"a token id of the dataset is outside the model's vocabulary [0, {model.cfg.vocab_size})")
    return windows.astype(np.int32), context_size


def statistics(source, saes: nn.Module, *, model=None, dataset=None, k: int = 8, radius: int = 8,
               intervals: int = 8, per_interval: int = 4, bins: int = 64, batch_size: int = 32,
               shard_size: int | None = None, context_size: int | None = None, column: str | None = None,
               name: str | None = None, out: str | os.PathLike | None = None, engine: str = "local",
               num_workers: int = 1, family: str | None = None, progress: ProgressArg = None) -> FeatureStatistics:
    """Every feature's statistics over a corpus, in one pass (see the module docstring).

    source: a `corpus.harvest` directory holding the value(s) `saes` reads (then `model=` gives the
      logits and token strings; default: the harvest's own model where it was loaded from a path), or,
      with `dataset` (anything `corpus.harvest` takes, packed to `context_size`), the model to run.
    saes: an SAE (SAELens, `saes.py`, one `Transcoder`), a `TranscoderSet` or a `CrossLayerTranscoder`.
    k: top windows per feature; `intervals` activation intervals of `per_interval` sampled windows; a
      histogram of `bins` bins; windows `radius` tokens either side.
    out: a directory for the checkpoint and the result: a rerun resumes there, and a finished one is
      loaded (refused if it is another job). engine "ray": `num_workers` actors, the same result.
    progress: tokens done (`progress.py`); a callable raising `Cancelled` stops it at a batch.
    """
    check_engine(engine, num_workers)
    for arg, value in (("k", k), ("batch_size", batch_size), *([] if shard_size is None else [("shard_size", shard_size)])):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r} must be a positive integer")
    limits = Limits(_d_sae(saes), k, intervals, per_interval, bins, radius)
    harvest_path = windows = None
    if dataset is None:
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError(f"source is a {type(source).__name__}: pass a harvest directory, or a model with dataset=")
        harvest_path = str(source)
        if model is None:
            model = _harvest_model(harvest_path, family)
        encs = encoders(model, saes, name)
        harvest, manifest = _check_harvest(harvest_path, model, saes, encs)
        rows, context_size = len(harvest), int(manifest["context_size"])
        corpus_id = {"harvest": manifest.get("dataset"), "model": manifest.get("model", {}).get("weights"),
                     "rows": rows}
        worker_model = None
    else:
        from hooked_models.corpus.source import resolve_model

        model, model_source = resolve_model(source, family, None, engine)
        encs = encoders(model, saes, name)
        for e in encs:
            if e.name not in model.hook_dict:
                raise ValueError(f"the model has no value {e.name!r} (what {type(saes).__name__} reads)")
        windows, context_size = _windows(model, dataset, context_size, column)
        rows = len(windows)
        corpus_id = {"windows": hashlib.sha256(windows.tobytes()).hexdigest(), "rows": rows}
        worker_model = model_source if engine == "ray" else model
    if rows == 0:
        raise ValueError("the corpus is empty: the harvest holds no rows")
    job = {"limits": {f: getattr(limits, f) for f in ("d_sae", "k", "intervals", "per_interval", "bins", "radius")},
           "encoders": [e.name for e in encs], "saes": _fingerprint(saes), "corpus": corpus_id,
           "batch_size": batch_size}
    out = None if out is None else Path(out)
    if out is not None and (out / META).is_file():
        done = FeatureStatistics.load(out)
        _refuse_other_job(done.job, job, out)
        return done
    shard_size = shard_size or 16 * batch_size
    plan = StatisticsPlan(harvest_path, windows, tuple(encs), limits, saes, batch_size, shard_size, rows,
                          context_size, torch.get_num_threads())
    job["shard_size"] = shard_size
    partials, done = ([Partial.empty(limits) for _ in encs], set()) if out is None else _resume(out, limits, len(encs), job)
    todo = [s for s in range(plan.shards) if s not in done]
    with tracker(progress, total=rows * context_size, desc="statistics", unit="tok") as bar:
        bar.advance(sum(_shard_rows(plan, s) for s in done) * context_size)
        if engine == "local":
            worker = StatisticsWorker(worker_model, plan)
            worker.on_batch = bar.advance
            results = ((s, worker.partials(s)) for s in todo)  # no serialising in one process
        else:
            results = (_deserialised(r, limits, len(encs)) for r in
                       run(StatisticsWorker, worker_model, plan, [{"shard": s} for s in todo], engine, num_workers))
        for shard, shard_partials in results:
            partials = [merge(p, q) for p, q in zip(partials, shard_partials)]
            done.add(shard)
            if engine != "local":
                bar.advance(_shard_rows(plan, shard) * context_size)
            if out is not None:
                _checkpoint(out, partials, sorted(done), job)
    result = _finish(model, saes, encs, partials, rows, context_size, job)
    if out is not None:
        result.save(out)
        (out / CHECKPOINT).unlink(missing_ok=True)
    return result


def _deserialised(result: dict, limits: Limits, n: int) -> tuple[int, list[Partial]]:
    tensors = load_bytes(bytes(result["partial"]))
    return int(result["shard"]), [Partial.from_tensors(limits, tensors, f"{i}.") for i in range(n)]


def _shard_rows(plan: StatisticsPlan, shard: int) -> int:
    start, stop = plan.shard_rows(shard)
    return stop - start


def _refuse_other_job(theirs: dict, mine: dict, out: Path) -> None:
    for key, value in mine.items():
        if theirs.get(key) != value:
            raise ValueError(f"{out} holds statistics of another job: its {key} is {theirs.get(key)!r}, this "
                             f"run's {value!r}; use another directory, or delete it to start over")


def _checkpoint(out: Path, partials: list[Partial], done: list[int], job: dict) -> None:
    """The merged partials and the shards in them, in one file (the shards and the job in its metadata),
    written under a temporary name and renamed into place: a kill leaves the previous checkpoint whole."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, part in enumerate(partials):
        tensors.update(part.tensors(f"{i}."))
    save_file(tensors, str(out / (CHECKPOINT + ".partial")), metadata={"job": json.dumps(job), "done": json.dumps(done)})
    os.replace(out / (CHECKPOINT + ".partial"), out / CHECKPOINT)


def _resume(out: Path, limits: Limits, n: int, job: dict) -> tuple[list[Partial], set[int]]:
    """The checkpoint's partials and shards done (none without one); another job's is refused."""
    if not (out / CHECKPOINT).is_file():
        return [Partial.empty(limits) for _ in range(n)], set()
    with safe_open(str(out / CHECKPOINT), "pt") as f:
        meta = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    _refuse_other_job(json.loads(meta["job"]), job, out)
    return [Partial.from_tensors(limits, tensors, f"{i}.") for i in range(n)], set(json.loads(meta["done"]))


def _harvest_model(path: str, family: str | None):
    manifest = json.loads((Path(path) / "manifest.json").read_text()) if (Path(path) / "manifest.json").is_file() else {}
    where = manifest.get("source")
    if not where or where == "a model object":
        open_harvest(path)  # a ValueError if it is no harvest at all
        raise ValueError(f"the harvest in {path} was written from a model object: pass model= for its logits and tokens")
    from hooked_models.corpus.source import load_model

    return load_model(where, family or {"HookedAlphaEr": "alpha_er"}.get(manifest["model"]["family"], "arcee"))


@torch.no_grad()
def _finish(model, saes, encs, partials, rows, context_size, job) -> FeatureStatistics:
    layers, used = [], []
    for enc, part in zip(encs, partials):
        directions = _directions(saes, enc.layer).detach()
        top, top_v, bottom, bottom_v, note = logit_table(model, directions, N_LOGITS)
        layers.append(LayerStatistics(enc.name, enc.layer, enc.transcoder_id, part, top, top_v, bottom, bottom_v, note))
        used += [t.flatten().long().unique() for t in (part.top.tokens, part.samples.tokens, top, bottom)]
    ids = [i for i in torch.cat(used).unique().tolist() if i != -1]  # unique() sorts
    if getattr(model, "tokenizer", None) is None:  # a model without one: tokens shown as their ids
        strings = {i: str(i) for i in ids}
    else:
        strings = dict(zip(ids, model.to_str_tokens(torch.tensor(ids, dtype=torch.long)) if ids else []))
    return FeatureStatistics(layers, context_size, rows, strings, getattr(model.cfg, "model_name", "") or "", job)


def logit_table(model, directions: torch.Tensor, n: int, chunk: int = 256):
    """Each direction's `n` most raised and most lowered tokens through the unembedding, W_dec[f] @ W_U
    (alpha-er's factored head multiplied through its factors): ids and weights [d_sae n] each, and a note
    (empty, or why there are none: a decoder that does not write the residual stream's width)."""
    d, width = directions.shape
    hidden = model.cfg.hidden_size
    empty = torch.zeros(d, 0, dtype=torch.long), torch.zeros(d, 0)
    if width != hidden:
        return (*empty, *empty, f"the decoder writes width {width}, not the residual stream's {hidden}: "
                                "no logit effect through the unembedding")
    W_U = model.W_U
    factored = hasattr(W_U, "A")
    dtype = W_U.A.dtype if factored else W_U.dtype
    n = min(n, model.cfg.vocab_size)
    parts = []
    for start in range(0, d, chunk):
        block = directions[start:start + chunk].to(dtype)
        logits = (block @ W_U.A @ W_U.B if factored else block @ W_U).float().cpu()
        up, down = logits.topk(n, dim=-1), logits.topk(n, dim=-1, largest=False)
        parts.append((up.indices, up.values, down.indices, down.values))
    return (*(torch.cat(p) for p in zip(*parts)), "")
