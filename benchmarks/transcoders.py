"""Training transcoders from a harvest on disk: peak memory over a corpus 10x as large.

    python benchmarks/transcoders.py                # harvests into /tmp (about 0.7 GB), trains, deletes

Harvests every layer's MLP input and output of the embedded Arcee over N and 10N IOI prompts, then trains
the same transcoders (same steps and batch) from each in a child process and reports its CPU time, its
peak anonymous memory (RssAnon, sampled every 5 ms: what the process allocates) and its peak resident
memory (VmHWM), which also counts the pages of the memory-mapped dataset the reads touched (file-backed
page cache, which the kernel reclaims under pressure). The trainer reads one batch of rows at a time, so
the anonymous peak should not grow with the corpus. Results go to benchmarks/results/transcoders.json,
from which benchmarks/figures.py renders the READMEs' figures.
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, memory, peak_anon_during  # noqa: E402


def child(harvest: str, steps: int) -> None:
    from hooked_models.transcoders import TrainingConfig, train_transcoders

    torch.set_num_threads(1)
    peak, cpu = peak_anon_during(lambda: train_transcoders(
        harvest, config=TrainingConfig(d_transcoder=256, activation="topk", k=16, steps=steps), progress=False))
    print(json.dumps({"peak_anon_bytes": peak, "peak_rss_bytes": memory("VmHWM"),
                      "file_rss_bytes": memory("RssFile"), "cpu_s": round(cpu, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4096, help="the 1x corpus (IOI prompts of 16 tokens)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/transcoder_bench"))
    parser.add_argument("--child", nargs=2, metavar=("HARVEST", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]))
    from hooked_models import corpus
    from hooked_models.embedded.task import make_ioi_prompts
    from hooked_models.transcoders import input_hook_name, output_hook_name

    record = Results("transcoders")
    names = [n for layer in range(2) for n in (input_hook_name(layer), output_hook_name(layer))]
    results = {}
    try:
        for scale in (1, 10):
            harvest = args.dir / f"x{scale}"
            tokens = make_ioi_prompts(args.prompts * scale, 11).clean_tokens
            corpus.harvest("embedded", tokens, names, harvest, progress=False)
            done = subprocess.run([sys.executable, __file__, "--child", str(harvest), str(args.steps)],
                                  stdout=subprocess.PIPE, text=True, check=True,
                                  env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin"})
            results[f"x{scale}"] = {"tokens": int(tokens.numel()), **json.loads(done.stdout.strip().splitlines()[-1])}
            print(scale, results[f"x{scale}"], flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    for field in ("peak_anon_bytes", "peak_rss_bytes"):
        results[f"{field}_10x_over_1x"] = round(results["x10"][field] / results["x1"][field], 3)
    record.save(results)
    print(results)


if __name__ == "__main__":
    main()
