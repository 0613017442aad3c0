"""Run by the distributed tests under torchrun (or alone): train small transcoders on the embedded Arcee
and save the result's tensors to --result (process 0). --kill-at STEP makes process --kill-rank kill itself
(SIGKILL, no clean-up) when its progress callable reports that step."""

import argparse
import os
import signal

import torch
from safetensors.torch import save_file

from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.families import load_model
from hooked_models.transcoders import TrainingConfig, train_transcoders

CONFIGS = {
    "topk": dict(activation="topk", k=8, auxk_alpha=1 / 32, dead_tokens=256),
    "batchtopk": dict(activation="batchtopk", k=8, skip=True),
    "jumprelu": dict(activation="jumprelu", sparsity=1e-2, pre_act_loss=1e-3),
    "clt": dict(activation="topk", k=8, cross_layer=True, skip=True),
}


def config(kind: str, layout: str, steps: int) -> TrainingConfig:
    return TrainingConfig(d_transcoder=32, steps=steps, batch_tokens=128, buffer_tokens=512, forward_batch=8,
                          streams=2, layout=layout, lr=3e-3, checkpoint_every=4, log_every=2, seed=3,
                          **CONFIGS[kind])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="topk")
    parser.add_argument("--layout", default="data")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--result", required=True)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model("embedded", "arcee")
    tokens = make_ioi_prompts(96, 5).clean_tokens

    def progress(step):
        if step.done == args.kill_at and int(os.environ.get("RANK", 0)) == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    tcs = train_transcoders(model, dataset=tokens, config=config(args.kind, args.layout, args.steps),
                            checkpoint=args.checkpoint, progress=progress)
    if int(os.environ.get("RANK", 0)) == 0:
        save_file({name: t.contiguous() for name, t in tcs.state_dict().items()}, args.result)


if __name__ == "__main__":
    main()
