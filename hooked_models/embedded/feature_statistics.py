"""Compute the embedded models' feature statistics and write them into the package.

    python -m hooked_models.embedded.feature_statistics                 # both families
    python -m hooked_models.embedded.feature_statistics --family arcee --out /tmp/stats

For each family: every feature of its shipped transcoders (`<family>/transcoders/`) over the IOI prompts
they were trained on (the first `PROMPTS` clean ones of the training seed), through the model
(`features.statistics`, one CPU thread so a rerun writes the same bytes), written to
`hooked_models/embedded/<family>/feature_statistics/`, which `features.FeatureStatistics.load` reads, so a
graph of the embedded model opens labelled: `graph.to_json(path, features=stats)`.
"""

import argparse
from pathlib import Path

import torch

from hooked_models import features
from hooked_models.embedded import EMBEDDED_DIR
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.embedded.train_transcoders import TRANSCODER_TRAIN_SEED
from hooked_models.families import FAMILIES, load_model
from hooked_models.transcoders import load_transcoders

PROMPTS = 1024
# Small enough to ship (about 0.5 MB a family), enough to read a feature by.
OPTIONS = dict(k=8, radius=5, intervals=4, per_interval=2, bins=64, batch_size=64)


def statistics_of(family: str, progress: bool | None = None) -> features.FeatureStatistics:
    """The shipped statistics of `family`, computed afresh."""
    model = load_model("embedded", family)
    tokens = make_ioi_prompts(PROMPTS, TRANSCODER_TRAIN_SEED).clean_tokens
    return features.statistics(model, load_transcoders("embedded", model=model), dataset=tokens, progress=progress,
                               **OPTIONS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (one family; default: hooked_models/embedded/<family>/feature_statistics)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: bit-reproducible)")
    args = parser.parse_args(argv)
    if args.out is not None and args.family == "all":
        parser.error("--out names one family's directory: pass --family too")
    torch.set_num_threads(args.threads)
    for family in FAMILIES if args.family == "all" else [args.family]:
        out = args.out or EMBEDDED_DIR / family / "feature_statistics"
        statistics_of(family).save(out)
        sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
        print(f"{family}: {out} {sizes}")


if __name__ == "__main__":
    main()
