"""`attribute_dataset`: the attribution graph of every prompt of a dataset, written to a graph store,
in this process or over a Ray cluster, resumable.

    store = attribute_dataset(model, ["When Mary and John ...", ...], transcoders, "out/graphs")
    store = attribute_dataset("embedded", {"tokens": ioi.clean_tokens, "answer": ioi.correct,
                              "wrong": ioi.incorrect}, "embedded", "out/ioi")      # a logit difference each
    store = attribute_dataset("path/to/model", prompts, "path/to/transcoders", "out/graphs",
                              engine="ray", num_workers=8)                         # the same files

Each graph is `attribute(model, prompt, transcoders, targets=..., **options)` on its own, the same bits
whichever engine, worker count or interruption produced it (tests/hooked_models/attribution/
test_dataset.py): the corpus engines run it (hooked_models/corpus/engines.py: one worker class, local and
Ray, the model and transcoders loaded once per worker from their paths), a graph per unit of work, and
hooked_models/attribution/store.py writes each graph whole and records it in the index. A rerun on the same
directory keeps the graphs written and computes the rest; another job's store is refused.
"""

import inspect
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hooked_models.attribution.attribute import attribute, check_arguments
from hooked_models.attribution.replacement import prompt_tokens
from hooked_models.attribution.store import (
    FORMAT,
    INDEX,
    GraphStore,
    graph_file,
    leftovers,
    refuse_other_store,
    save_index,
    transcoders_identity,
    write_graph,
)
from hooked_models.corpus.engines import Worker, check_engine, run
from hooked_models.corpus.source import model_identity, resolve_model
from hooked_models.corpus.store import check_out, locked
from hooked_models.progress import ProgressArg, tracker
from hooked_models.transcoders import load_transcoders

# `attribute`'s options a store records (each graph is computed with them); the prompt, its targets and
# progress are per graph.
OPTIONS = {name: p.default for name, p in inspect.signature(attribute).parameters.items()
           if p.kind is p.KEYWORD_ONLY and name not in ("targets", "progress")}
# The columns a dataset's rows may have: the prompt as text or token ids, and a logit-difference target.
PROMPT_COLUMNS = ("prompt", "text", "tokens", "input_ids", "clean")
TARGET_COLUMNS = ("answer", "wrong")


@dataclass(frozen=True)
class GraphPlan:
    """What every worker needs (sent to Ray actors): where to write, the prompts, the transcoders (a path
    each Ray worker loads, or the set itself in this process), `attribute`'s options."""

    out: str
    prompts: tuple
    transcoders: object
    options: dict
    threads: int


class GraphWorker(Worker):
    """One graph per call: `attribute` on its prompt, written to the store whole."""

    def __init__(self, model, plan: GraphPlan):
        super().__init__(model, plan)
        tcs = plan.transcoders
        device = next(self.model.parameters()).device
        self.transcoders = load_transcoders(tcs, model=self.model, device=device) if isinstance(tcs, str) else tcs

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        plan, done = self.plan, []
        for i in batch["graph"].tolist():
            graph = attribute(self.model, prompt_of(plan.prompts[i]), self.transcoders,
                              targets=targets_of(plan.prompts[i]), progress=False, **plan.options)
            write_graph(Path(plan.out), i, graph, plan.options["node_threshold"], plan.options["edge_threshold"])
            done.append(i)
        return {"graph": np.asarray(done, dtype=np.int64)}


def prompt_of(entry: dict):
    """What `attribute` is given for an index entry: its text if it came as text (the graph keeps it),
    else its token ids."""
    return entry["prompt"] if entry["prompt"] is not None else torch.tensor(entry["tokens"], dtype=torch.long)


def targets_of(entry: dict):
    """`attribute`'s targets for an index entry: its (answer, wrong) logit difference, or None (the
    salient logits)."""
    return None if entry["target"] is None else [tuple(entry["target"])]


def _columns(dataset) -> dict[str, list]:
    """The dataset as named columns of one length each."""
    if isinstance(dataset, (str, bytes)):
        raise ValueError("dataset is one string; give a list of prompts (or a dataset of them)")
    if all(hasattr(dataset, a) for a in ("clean_tokens", "correct", "incorrect")):  # embedded.task.IOIPrompts
        return {"tokens": list(dataset.clean_tokens), "answer": dataset.correct.tolist(),
                "wrong": dataset.incorrect.tolist()}
    if isinstance(dataset, (torch.Tensor, np.ndarray)):
        if dataset.ndim != 2:
            raise ValueError(f"dataset of token ids must be [prompts seq], got shape {tuple(dataset.shape)}")
        return {"tokens": list(dataset)}
    if isinstance(dataset, (list, tuple)):
        key = "prompt" if dataset and isinstance(dataset[0], str) else "tokens"
        return {key: list(dataset)}
    if not isinstance(dataset, dict):
        from hooked_models.corpus.data import open_dataset

        opened = open_dataset(dataset)
        dataset = {name: list(opened[name]) for name in opened.column_names}
    columns = {name: list(values) for name, values in dataset.items()}
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"the dataset's columns differ in length: {lengths}")
    return columns


def dataset_prompts(model, dataset) -> list[dict]:
    """Each prompt as the index records it: its text (None if given as ids), its token ids, and its target
    ([answer, wrong] token ids, or None for the salient logits)."""
    columns = _columns(dataset)
    found = [c for c in PROMPT_COLUMNS if c in columns]
    if not found:
        raise ValueError(f"the dataset has no prompt column ({', '.join(PROMPT_COLUMNS)}); it has "
                         f"{', '.join(columns) or 'none'}")
    given = [c for c in TARGET_COLUMNS if c in columns]
    if len(given) == 1:
        raise ValueError(f"the dataset has a {given[0]!r} column but no {({*TARGET_COLUMNS} - {given[0]}).pop()!r}: "
                         "a logit-difference target needs both")
    prompts, vocab = columns[found[0]], model.cfg.vocab_size
    if len(prompts) == 0:
        raise ValueError("the dataset is empty: give at least one prompt")
    entries = []
    for i, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else None
        try:
            tokens = prompt_tokens(model, prompt)[0].tolist()
        except ValueError as error:
            raise ValueError(f"prompt {i}: {error}") from None
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"prompt {i} has token id {min(tokens) if min(tokens) < 0 else max(tokens)}, outside "
                             f"the model's vocabulary [0, {vocab})")
        target = None
        if given:
            target = [_target(columns[c][i]) for c in TARGET_COLUMNS]
        entries.append({"prompt": text, "tokens": tokens, "target": target})
    return entries


def _target(value) -> int | str:
    """A target as JSON keeps it: a token id (int) or a token string."""
    if isinstance(value, str):
        return value
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"a target {value!r} must be a token id or a token string")
    return value


def _settings(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"attribute_dataset got unknown options {unknown}; it passes attribute's "
                         f"{', '.join(OPTIONS)}")
    settings = {**OPTIONS, **options}
    if not isinstance(settings["qk"], int):  # entries as JSON lists, each a (layer, head, query_pos, key_pos)
        settings["qk"] = [list(entry) for entry in settings["qk"]]
    return settings


def attribute_dataset(model, dataset, transcoders, out: "str | os.PathLike", *, engine: str = "local",
                      num_workers: int = 1, resume: bool = True, progress: ProgressArg = None,
                      family: str | None = None, dtype=None, **options) -> GraphStore:
    """The attribution graph of every prompt of `dataset`, written to the graph store `out`
    (hooked_models/attribution/store.py); returns the store.

    model: a checkpoint path, "embedded", a cached Hub id, or (engine "local") a hooked model; `family`
      and `dtype` as `corpus.harvest`'s. transcoders: a directory `load_transcoders` reads ("embedded":
      the embedded model's), or (engine "local") a TranscoderSet or CrossLayerTranscoder.
    dataset: prompts as a list of texts or of token-id lists, token ids [prompts seq], a dict of columns
      or a `datasets` Dataset (or its path): a prompt column (`prompt`/`text` or `tokens`/`input_ids`/
      `clean`) and, for contrastive pairs, `answer` and `wrong` (token ids or one-token strings): each
      prompt's graph then has one output node, the logit difference answer - wrong. Without them each graph
      has the salient logits. `hooked_models.embedded.task.IOIPrompts` is read as its clean prompts with
      `correct` - `incorrect`.
    options: `attribute`'s (max_feature_nodes, desired_logit_prob, max_n_logits, batch_size,
      head_loadings, qk, node_threshold, edge_threshold), the same for every graph; the files are pruned
      at node_threshold and edge_threshold, as `to_json` prunes.
    engine: "local" or "ray" (`num_workers` actors, each loading the model and transcoders once, from
      their paths). resume: continue the store in `out` (refused if another model, transcoders, settings
      or prompts wrote it; a graph recorded but missing is computed again); False refuses a non-empty `out`.
    progress: graphs done (hooked_models/progress.py); a callable raising `Cancelled` stops the run after a
      graph, every graph written so far kept for a rerun.
    """
    check_engine(engine, num_workers)
    settings = _settings(options)
    out = Path(out)
    check_out(out, resume, [*leftovers(out), out / ".lock"] if out.is_dir() else [], INDEX, "graph store")
    if engine == "ray" and not isinstance(transcoders, (str, os.PathLike)):
        raise ValueError("engine='ray' loads the transcoders in each worker from a path; pass their directory "
                         "(transcoders.save(dir) writes one), or use engine='local'")
    model, source = resolve_model(model, family, dtype, engine)
    tcs = (load_transcoders(str(transcoders), model=model, device=next(model.parameters()).device)
           if isinstance(transcoders, (str, os.PathLike)) else transcoders)
    entries = dataset_prompts(model, dataset)
    first = torch.tensor([entries[0]["tokens"]], device=next(model.parameters()).device)
    check_arguments(model, first, tcs, *(settings[k] for k in ("max_feature_nodes", "desired_logit_prob",
                                                                 "max_n_logits", "batch_size", "head_loadings", "qk",
                                                                 "keep_position_zero")))
    job = {"format": FORMAT, "model": model_identity(model), "transcoders": transcoders_identity(tcs),
           "settings": settings, "prompts": entries}
    out.mkdir(parents=True, exist_ok=True)
    with locked(out, "attribute_dataset run"):
        for path in leftovers(out):  # a killed run's temporaries: the lock held, nobody writes them
            _remove(path)
        index = {}
        if (out / INDEX).is_file():
            index = json.loads((out / INDEX).read_text())
            refuse_other_store(index, job, out)
        if not index:
            index = {**job, "sources": {"model": source.source if source else "a model object",
                                        "transcoders": str(transcoders) if isinstance(transcoders, (str, os.PathLike))
                                        else "a transcoder object"}, "done": []}
            save_index(out, index)
        # A graph recorded but whose files are gone (deleted by hand) is computed again.
        done = {i for i in index["done"] if (out / graph_file(i)).is_file()
                and (out / graph_file(i)).with_name(f"{i:05d}.tensors.safetensors").is_file()}
        todo = [i for i in range(len(entries)) if i not in done]
        plan = GraphPlan(str(out), tuple(entries), str(transcoders) if engine == "ray" else tcs, settings,
                         torch.get_num_threads())
        (out / ".tmp").mkdir(exist_ok=True)
        with tracker(progress, total=len(entries), desc="attribute_dataset", unit="graph") as steps:
            steps.advance(len(done))  # graphs already written
            worker_model = source if engine == "ray" else model
            for row in run(GraphWorker, worker_model, plan, [{"graph": i} for i in todo], engine, num_workers):
                done.add(int(row["graph"]))
                index["done"] = sorted(done)
                save_index(out, index)
                steps.advance(1)
        _remove(out / ".tmp")
    return GraphStore(out)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
