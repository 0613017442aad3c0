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

One module per concern, each importing only those listed before it (the contract in pyproject.toml):
source (the model), data (the corpus read and packed), engines (local and Ray), store (the harvest's
directory: windows, shards, manifest, lock), harvester (`harvest`), patcher (`patch`).
"""

from hooked_models.corpus.data import TEXT_COLUMNS, TOKEN_COLUMNS, pack
from hooked_models.corpus.engines import ACTOR_CPUS, ENGINES
from hooked_models.corpus.harvester import SHARD_BYTES, STORAGE, HarvestPlan, HarvestSummary, HarvestWorker, harvest
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

__all__ = [
    "ACTOR_CPUS", "ENGINES", "FORMAT", "IDENTITY", "MANIFEST", "METRICS", "PAIR_COLUMNS", "SHARD_BYTES", "SHARD_FILE",
    "STORAGE", "TEXT_COLUMNS", "TOKEN_COLUMNS", "WINDOWS", "CorpusPatchingResult", "HarvestPlan", "HarvestSummary",
    "HarvestWorker", "ModelSource", "PatchPlan", "PatchWorker", "harvest", "load_model", "logit_diff",
    "model_identity", "pack", "patch", "read_windows", "shard_file",
]
