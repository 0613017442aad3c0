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

# For developers, the package's layout: one module per concern, each importing only those listed before it (the
# contract in pyproject.toml): source (the model), data (the corpus read and packed), engines (local and Ray), store
# (the harvest's directory: windows, shards, manifest, lock), harvester (`harvest`), patcher (`patch`). The public
# names below are imported from them on first use, so the command line's --help imports no torch.


import importlib
from typing import TYPE_CHECKING

ENGINES = ("local", "ray")

# Each public name and the module that defines it.
_PUBLIC = {
    **dict.fromkeys(("TEXT_COLUMNS", "TOKEN_COLUMNS", "pack"), "data"),
    **dict.fromkeys(("ACTOR_CPUS",), "engines"),
    **dict.fromkeys(("SHARD_BYTES", "STORAGE", "HarvestPlan", "HarvestSummary", "HarvestWorker", "harvest"),
                    "harvester"),
    **dict.fromkeys(("METRICS", "PAIR_COLUMNS", "CorpusPatchingResult", "PatchPlan", "PatchWorker", "logit_diff",
                     "patch"), "patcher"),
    **dict.fromkeys(("ModelSource", "load_model", "model_identity"), "source"),
    **dict.fromkeys(("FORMAT", "IDENTITY", "MANIFEST", "SHARD_FILE", "WINDOWS", "read_windows", "shard_file"),
                    "store"),
}
__all__ = sorted(["ENGINES", *_PUBLIC])

if TYPE_CHECKING:
    from hooked_models.corpus.data import TEXT_COLUMNS, TOKEN_COLUMNS, pack
    from hooked_models.corpus.engines import ACTOR_CPUS
    from hooked_models.corpus.harvester import (
        SHARD_BYTES,
        STORAGE,
        HarvestPlan,
        HarvestSummary,
        HarvestWorker,
        harvest,
    )
    from hooked_models.corpus.patcher import (
        METRICS,
        PAIR_COLUMNS,
        CorpusPatchingResult,
        PatchPlan,
        PatchWorker,
        logit_diff,
        patch,
    )
    from hooked_models.corpus.source import ModelSource, load_model, model_identity
    from hooked_models.corpus.store import FORMAT, IDENTITY, MANIFEST, SHARD_FILE, WINDOWS, read_windows, shard_file


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hooked_models.corpus' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hooked_models.corpus.{_PUBLIC[name]}"), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
