"""Run by the distributed tests under torchrun (or alone): train small transcoders of each --kinds on the
embedded Arcee and save each result's tensors to --out/{kind}.safetensors (process 0). --kill-at STEP makes
process --kill-rank kill itself (SIGKILL, no clean-up) when its progress callable reports that step.
--check-topk writes --out/topk.json: whether each activation chosen across the processes' feature shards
(TopK, BatchTopK, AuxK's dead features) is the unsharded one."""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file

from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.families import load_model
from hooked_models.transcoders import TrainingConfig, topk_relu, train_transcoders

CONFIGS = {
    "topk": dict(activation="topk", k=8, auxk_alpha=1 / 32, dead_tokens=256, init_spread="equal"),
    "batchtopk": dict(activation="batchtopk", k=8, skip=True),
    "jumprelu": dict(activation="jumprelu", sparsity=1e-2, pre_act_loss=1e-3),
    "clt": dict(activation="topk", k=8, cross_layer=True, skip=True),
}


def config(kind: str, layout: str, steps: int) -> TrainingConfig:
    return TrainingConfig(d_transcoder=32, steps=steps, batch_tokens=128, buffer_tokens=512, forward_batch=8,
                          streams=2, layout=layout, lr=3e-3, checkpoint_every=4, log_every=2, seed=3,
                          **CONFIGS[kind])


def check_topk(out: Path) -> None:
    """TopK and BatchTopK over two feature shards against the unsharded choice, on the same pre-activations."""
    from hooked_models.transcoders.training.distributed import Layout, process_group
    from hooked_models.transcoders.training.losses import activate, auxk_acts

    with process_group():
        layout = Layout("features", 32)
        pre = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
        mine = pre[:, layout.features]
        topk, _ = activate("topk", mine, layout, k=8)
        batch, _ = activate("batchtopk", mine, layout, k=8, batch_tokens=64)
        topk, batch = layout.gather_features(topk), layout.gather_features(batch)
        kept = torch.relu(pre).flatten().topk(8 * 64).indices
        whole = torch.zeros(64 * 32).index_fill_(0, kept, 1).view(64, 32) * torch.relu(pre)
        # AuxK over 12 dead features, 9 of them on shard 0 and 3 on shard 1, k_aux = 5: each token's 5
        # largest dead pre-activations chosen across the shards.
        dead = torch.zeros(32, dtype=torch.bool)
        dead[[1, 4, 5, 7, 8, 10, 11, 13, 15, 17, 22, 30]] = True
        aux, features = auxk_acts(mine, dead[layout.features], 5, 12, layout)
        aux = layout.gather_features(torch.zeros_like(mine).index_copy_(1, features, aux))
        dead_pre = torch.where(dead, pre, torch.full_like(pre, -torch.inf))
        chosen = torch.zeros_like(pre).scatter_(1, dead_pre.topk(5, dim=-1).indices, 1) * torch.relu(pre)
        if layout.rank == 0:
            (out / "topk.json").write_text(json.dumps({
                "topk_equal": torch.equal(topk, topk_relu(pre, 8)), "batchtopk_equal": torch.equal(batch, whole),
                "batchtopk_kept": int((batch > 0).sum()), "shard_width": mine.shape[1],
                "auxk_equal": torch.equal(aux, chosen)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="+", default=["topk"])
    parser.add_argument("--layout", default="data")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--check-topk", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_model("embedded", "arcee")
    tokens = make_ioi_prompts(96, 5).clean_tokens
    rank = int(os.environ.get("RANK", 0))

    def progress(step):
        if step.done == args.kill_at and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    for kind in args.kinds:
        checkpoint = None if args.checkpoint is None else f"{args.checkpoint}/{kind}"
        tcs = train_transcoders(model, dataset=tokens, config=config(kind, args.layout, args.steps),
                                checkpoint=checkpoint, progress=progress)
        if rank == 0:
            save_file({name: t.contiguous() for name, t in tcs.state_dict().items()}, args.out / f"{kind}.safetensors")
    if args.check_topk:
        check_topk(args.out)


if __name__ == "__main__":
    main()
