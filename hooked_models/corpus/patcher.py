"""`patch`: activation patching over a dataset of prompt pairs, a chunk of pairs per unit of work,
combined into the mean over the pairs."""

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.corpus.data import open_dataset
from hooked_models.corpus.engines import Worker, check_engine, run
from hooked_models.corpus.source import model_source, resolve_model
from hooked_models.patching import PatchingResult, activation_patch
from hooked_models.progress import ProgressArg, tracker


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


class PatchWorker(Worker):
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
        dataset = open_dataset(pairs)
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
    progress: ProgressArg = None,
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
    check_engine(engine, num_workers)
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
        worker_model = model_source(model, family, dtype)
    else:
        worker_model, _ = resolve_model(model, family, dtype, engine)
    plan = PatchPlan(value, None if over is None else tuple(over), metric, per_pair, options, torch.get_num_threads())
    items = [{"chunk": c, **{k: v[start:start + chunk_size].numpy() for k, v in columns.items()}}
             for c, start in enumerate(range(0, total, chunk_size))]
    chunks = {}
    with tracker(progress, total=total * seq, desc=f"patch {value}", unit="tok", unit_scale=True) as steps:
        for row in run(PatchWorker, worker_model, plan, items, engine, num_workers):
            finished = pickle.loads(row["result"])
            chunks[finished["chunk"]] = finished
            steps.advance(finished["pairs"] * seq)
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
