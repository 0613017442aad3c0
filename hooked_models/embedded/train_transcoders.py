"""Train the embedded models' transcoders and write them into the package.

    python -m hooked_models.embedded.train_transcoders                 # both families
    python -m hooked_models.embedded.train_transcoders --family arcee --out /tmp/tc

For each family: train TopK transcoders on every layer's MLP input and output over IOI prompts (clean
and corrupted, drawn with seeds no test or evaluation uses), streamed from the model
(`hooked_models.transcoders.train_transcoders`, seeded, one CPU thread by default so a rerun writes
the same bytes), measure their fidelity on held-out prompts, and write circuit-tracer's layout to
`hooked_models/embedded/<family>/transcoders/` with the figures in its `training.json`.
`load_transcoders("embedded", model=model)` loads them.

The shipped files were written by the trainer this package had before `transcoders/training/` (from a
harvest, the decoder rows' unit-norm initialization, no bias centring; their `training.json` states the
recipe and figures). Rerunning this script now trains with the current trainer, which on this recipe
explains more of layer 0 (benchmarks/transcoder_training.py); the shipped ones stay until the feature
statistics and tutorials built on them are regenerated with them.
"""

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hooked_models.embedded import EMBEDDED_DIR
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.families import FAMILIES, load_model
from hooked_models.transcoders import TrainingConfig, train_transcoders, transcoder_fidelity

# Prompts the transcoders train on (seed) and are measured on (held out: a seed no training draws).
TRANSCODER_TRAIN_SEED = 3_000_000
TRANSCODER_TRAIN_PROMPTS = 4096
HELD_OUT_SEED = 8
HELD_OUT_PROMPTS = 512

# The recipe the shipped transcoders were trained with (no warm-up: it predates the default one).
CONFIG = TrainingConfig(d_transcoder=256, activation="topk", k=16, steps=1500, batch_tokens=1024, lr=2e-3, seed=0,
                        warmup_steps=0, decay_fraction=0.2, init="tied")


def train_family(family: str, out: Path, config: TrainingConfig = CONFIG, progress: bool | None = None) -> dict:
    """Train, save to `out` and return the fidelity figures (also written to out/training.json)."""
    model = load_model("embedded", family)
    prompts = make_ioi_prompts(TRANSCODER_TRAIN_PROMPTS, TRANSCODER_TRAIN_SEED)
    tokens = torch.cat([prompts.clean_tokens, prompts.corrupted_tokens])
    began = time.process_time()
    transcoders = train_transcoders(model, dataset=tokens, config=config, progress=progress)
    seconds = time.process_time() - began
    transcoders.save(out)
    held_out = make_ioi_prompts(HELD_OUT_PROMPTS, HELD_OUT_SEED).clean_tokens
    figures = {**transcoder_fidelity(model, transcoders, held_out),
               "held_out": {"prompts": HELD_OUT_PROMPTS, "seed": HELD_OUT_SEED},
               "train": {"prompts": 2 * TRANSCODER_TRAIN_PROMPTS, "seed": TRANSCODER_TRAIN_SEED,
                         "tokens": int(tokens.numel()), "cpu_seconds": round(seconds, 1),
                         "threads": torch.get_num_threads()},
               "config": asdict(config)}
    (out / "training.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (one family; default: hooked_models/embedded/<family>/transcoders)")
    parser.add_argument("--steps", type=int, default=CONFIG.steps)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: bit-reproducible)")
    args = parser.parse_args(argv)
    if args.out is not None and args.family == "all":
        parser.error("--out names one family's directory: pass --family too")
    torch.set_num_threads(args.threads)
    config = TrainingConfig(**{**asdict(CONFIG), "steps": args.steps})
    for family in FAMILIES if args.family == "all" else [args.family]:
        out = args.out or EMBEDDED_DIR / family / "transcoders"
        figures = train_family(family, out, config)
        print(f"{family}: variance explained {[round(v, 4) for v in figures['variance_explained']]}, "
              f"loss recovered {figures['loss_recovered']:.4f} (loss {figures['loss']:.4f}, spliced "
              f"{figures['loss_spliced']:.4f}) -> {out}", flush=True)


if __name__ == "__main__":
    main()
