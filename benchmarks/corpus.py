"""Corpus-scale runs: harvest throughput here (local) and on a Ray cluster of this machine (1 and 2
workers), and the peak memory of a local harvest at 1x and 10x the corpus.

    python benchmarks/corpus.py                          # about 5 minutes on 2 cores
    python benchmarks/corpus.py --rows 256 --rounds 1    # a quick look

The model is a random Arcee saved as a checkpoint (each Ray worker loads its own copy from it), the
corpus random token windows saved as a `datasets` dataset. Each contender harvests the last layer's
output over the whole corpus into a fresh directory; the first round checks that the three outputs are
the same bytes. Times are wall clock (Ray's work is in other processes), medians of interleaved rounds,
and include what a user waits for: the driver's planning load, Ray's actors starting and loading their
replicas (the cluster itself is started once, as a running cluster would be). Every process computes
on one thread. Targets: Ray with 1 worker within 1.3x of local's time; peak RSS at 10x the corpus within
1.2x of 1x (measured in fresh processes, from /proc/self/status's VmHWM). The figures go to
benchmarks/results/corpus.json.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, hf_arcee_config, interleaved, memory, randomize_, timings  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("layers", 4), ("hidden", 256), ("heads", 4), ("kv-heads", 2), ("head-dim", 64),
                          ("intermediate", 1024), ("vocab", 8192)]:
        parser.add_argument(f"--{name}", type=int, default=default, help=f"model shape (default: {default})")
    parser.add_argument("--context", type=int, default=128, help="tokens per window (default: 128)")
    parser.add_argument("--rows", type=int, default=2048, help="windows in the throughput corpus (default: 2048)")
    parser.add_argument("--memory-rows", type=int, default=256, help="windows in the 1x memory corpus (default: 256)")
    parser.add_argument("--batch", type=int, default=16, help="windows per forward (default: 16)")
    parser.add_argument("--shard", type=int, default=128,
                        help="windows per shard, Ray's unit of work, in the throughput runs (default: 128)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--results", default="corpus",
                        help="write the figures to benchmarks/results/RESULTS.json (default: %(default)s)")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "DATASET", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def write_corpus(path: Path, rows: int, args) -> None:
    import datasets

    windows = np.random.default_rng(rows).integers(0, args.vocab, (rows, args.context), dtype=np.int32)
    datasets.Dataset.from_dict({"tokens": windows}).save_to_disk(str(path))


def child(model: str, dataset: str, out: str, args) -> None:
    """One local harvest in this fresh process; its peak memory as JSON on stdout's last line."""
    from hooked_models import corpus

    baseline = memory("VmRSS")
    summary = corpus.harvest(model, dataset, [f"layers.{args.layers - 1}.layer_output"], out, batch_size=args.batch)
    print(json.dumps(dict(baseline=baseline, peak=memory("VmHWM"), rows=summary.rows, shards=summary.shards,
                          seconds=summary.seconds)))


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    if args.child:
        return child(*args.child, args)
    record = Results(args.results)
    import ray
    from transformers import ArceeForCausalLM

    from hooked_models import corpus

    work = Path(tempfile.mkdtemp(prefix="corpus_bench_"))
    try:
        model_dir = work / "model"
        randomize_(ArceeForCausalLM(hf_arcee_config(args)), 0).save_pretrained(model_dir)
        write_corpus(work / "corpus", args.rows, args)
        names = [f"layers.{args.layers - 1}.layer_output"]
        tokens = args.rows * args.context
        print(f"Arcee {args.layers} layers x {args.hidden} (random, {model_dir}); corpus {args.rows} windows x "
              f"{args.context} tokens = {tokens} tokens; batch {args.batch}; harvesting {names[0]}")

        # Ray's workers compute with this process's thread count (1), and each reserves half a CPU.
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
        runs = {"local": dict(), "ray, 1 worker": dict(engine="ray", num_workers=1),
                "ray, 2 workers": dict(engine="ray", num_workers=2)}
        outputs = {}

        def contender(name: str, options: dict):
            def run():
                out = work / f"out-{len(outputs)}"
                corpus.harvest(str(model_dir), str(work / "corpus"), names, out, batch_size=args.batch,
                               shard_size=args.shard, **options)
                if name not in outputs:
                    outputs[name] = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != ".lock"}
                shutil.rmtree(out)
            return run

        medians = interleaved({name: contender(name, options) for name, options in runs.items()}, args.rounds,
                              warmup=0)
        ray.shutdown()
        same = all(files == outputs["local"] for files in outputs.values())
        print(f"\nthroughput (wall clock, median of {args.rounds}; outputs identical bytes: {same})")
        local = medians["local"][1]
        for name, (_, wall) in medians.items():
            print(f"  {name:<16} {wall:7.1f} s  {tokens / wall:9,.0f} tokens/s  {wall / local:5.2f}x local's time")
        print(f"  target: ray with 1 worker <= 1.3x local's time: "
              f"{'met' if medians['ray, 1 worker'][1] <= 1.3 * local else 'NOT met'}")

        peaks = {}
        for scale in (1, 10):
            rows = args.memory_rows * scale
            write_corpus(work / f"memory-{scale}", rows, args)
            done = subprocess.run([sys.executable, __file__, "--child", str(model_dir), str(work / f"memory-{scale}"),
                                   str(work / f"memory-out-{scale}"), *sys.argv[1:]], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode:
                sys.exit(f"the {scale}x memory run failed (exit {done.returncode})")
            peaks[scale] = json.loads(done.stdout.strip().splitlines()[-1])
        mb = 2**20
        print(f"\npeak RSS of a local harvest (fresh process; batch {args.batch}, default shard size)")
        for scale, r in peaks.items():
            print(f"  {scale:>2}x: {r['rows']:6} windows in {r['shards']} shard(s), {r['seconds']:6.1f} s: peak "
                  f"{r['peak'] / mb:7.1f} MiB (after imports {r['baseline'] / mb:.1f} MiB)")
        ratio = peaks[10]["peak"] / peaks[1]["peak"]
        print(f"  10x / 1x: {ratio:.3f} (target <= 1.2: {'met' if ratio <= 1.2 else 'NOT met'})")
        record.save({"tokens": tokens, "rounds": args.rounds, "identical_outputs": same,
                     "throughput": timings(medians), "memory": {f"{scale}x": r for scale, r in peaks.items()}})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    if not any(a == "--child" for a in sys.argv):
        print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)")
