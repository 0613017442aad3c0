"""Training transcoders: streamed from the live model or read from a harvest, in one process or many.

    train_transcoders(model, dataset=tokens, config=TrainingConfig(activation="topk", k=16), out="out/tc")
    torchrun --nproc-per-node 2 -m hooked_models train-transcoders embedded --dataset ... --out out/tc
    train_transcoders_on_ray("embedded", num_workers=2, dataset="tokens.npy", config=config)   # Ray Train
"""

# For developers, the package's layout: one module per concern, each importing only those listed after it (the
# contract in pyproject.toml): `ray_launcher` (`train_transcoders_on_ray`: Ray Train starts the processes);
# `trainer` (`train_transcoders`, the loop); `checkpoints` (per shard, resumable) and `report` (training.json, its
# curves, `read_result`); `objective` (one batch's loss); `state` (this process's shard of the transcoders);
# `losses` (FVU, AuxK, the sparsity penalties, activations chosen across shards) and `sources` (the streaming buffer
# over the live model, a harvest on disk); `init` (first weights); `distributed` (the process group, the data-
# parallel and feature-sharded layouts) and `config` (`TrainingConfig`).

from hooked_models.transcoders.training.config import TrainingConfig
from hooked_models.transcoders.training.init import init_transcoder_, new_transcoders
from hooked_models.transcoders.training.ray_launcher import train_transcoders_on_ray
from hooked_models.transcoders.training.sources import HarvestReader, StreamingSource
from hooked_models.transcoders.training.trainer import lr_factor, train_transcoders

__all__ = ["HarvestReader", "StreamingSource", "TrainingConfig", "init_transcoder_", "lr_factor", "new_transcoders",
           "train_transcoders", "train_transcoders_on_ray"]
