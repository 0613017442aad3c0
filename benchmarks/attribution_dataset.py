"""Attribution graphs over a dataset (`attribution.attribute_dataset`): graphs per second, store size per graph,
Ray against local, and peak memory against the number of prompts.

    python benchmarks/attribution_dataset.py                              # 200 IOI prompts, 24 random-Arcee ones
    python benchmarks/attribution_dataset.py --prompts 1000 --random-prompts 300   # the issue's sizes (long)

- The embedded Arcee and its shipped transcoders on `--prompts` IOI prompt pairs (a logit difference each,
  `attribute`'s defaults otherwise: every active feature, head loadings and QK for the pruned graph): the
  local engine, then Ray with 2 workers on a local cluster of this machine (each worker loads the model and
  transcoders from their paths; the cluster is started once, as a running one would be, and its start is not
  timed). Wall clock, which includes the workers' start and load under Ray; the two stores are compared byte
  for byte.
- The random 8 x 1024 GQA Arcee of benchmarks/attribution.py with random TopK transcoders (4,096 features,
  k = 8) on `--random-prompts` random 32-token prompts, `max_feature_nodes=256`, no head loadings, salient
  logits; local engine.
- Peak memory: a local run over `--memory-prompts` prompts and over 4x as many, each in a fresh process
  (/proc/self/status's VmHWM), embedded Arcee.

Every process computes on one thread. The figures go to benchmarks/results/attribution_dataset.json, which
benchmarks/figures.py renders into benchmarks/README.md and docs/guide/attribution-over-a-dataset.md.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, memory  # noqa: E402

EMBEDDED_OPTIONS = {}  # attribute's defaults
RANDOM_OPTIONS = dict(max_feature_nodes=256, head_loadings=False)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200, help="IOI prompts on the embedded Arcee (default: 200)")
    parser.add_argument("--random-prompts", type=int, default=24,
                        help="32-token prompts on the random 8 x 1024 Arcee (default: 24)")
    parser.add_argument("--memory-prompts", type=int, default=50,
                        help="prompts of the 1x memory run; the other runs 4x as many (default: 50)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    parser.add_argument("--results", default="attribution_dataset",
                        help="write the figures to benchmarks/results/RESULTS.json (default: %(default)s)")
    parser.add_argument("--child", nargs=2, metavar=("PROMPTS", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def store_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != ".lock")


def files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def ioi(n: int):
    from hooked_models.embedded.task import build_tokenizer, make_ioi_prompts

    return make_ioi_prompts(n, seed=0, tokenizer=build_tokenizer())


def timed(fn) -> tuple[object, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def child(prompts: int, out: str) -> None:
    """One local run over `prompts` IOI prompts in this fresh process; its peak memory as JSON on stdout's last line."""
    from hooked_models.attribution import attribute_dataset

    baseline = memory("VmRSS")
    store, _, wall = timed(lambda: attribute_dataset("embedded", ioi(prompts), "embedded", out, progress=False,
                                                     **EMBEDDED_OPTIONS))
    print(json.dumps({"prompts": len(store), "baseline_bytes": baseline, "peak_bytes": memory("VmHWM"),
                      "wall_s": round(wall, 2)}))


def embedded_runs(args, work: Path) -> dict:
    from hooked_models.attribution import attribute_dataset

    prompts = ioi(args.prompts)
    runs = {}
    store, cpu, wall = timed(lambda: attribute_dataset("embedded", prompts, "embedded", work / "local",
                                                       progress=False, **EMBEDDED_OPTIONS))
    runs["local"] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "graphs_per_s": round(len(store) / wall, 3)}
    size = store_bytes(store.path)
    graph = store[0]
    print(f"embedded Arcee, {len(store)} IOI prompts: local {wall:.1f} s ({len(store) / wall:.2f} graphs/s); "
          f"store {size / 2**20:.1f} MiB ({size / len(store) / 1024:.0f} KiB per graph; a graph of "
          f"{graph.n_features} features, {graph.n_nodes} nodes)")
    identical = None
    if not args.no_ray:
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
        try:
            there, cpu, wall = timed(lambda: attribute_dataset("embedded", prompts, "embedded", work / "ray",
                                                               engine="ray", num_workers=2, progress=False,
                                                               **EMBEDDED_OPTIONS))
        finally:
            ray.shutdown()
        runs["ray, 2 workers"] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                                  "graphs_per_s": round(len(there) / wall, 3)}
        identical = files(there.path) == files(store.path)
        print(f"  ray, 2 workers: {wall:.1f} s ({len(there) / wall:.2f} graphs/s); stores identical bytes: {identical}")
    return {"prompts": len(store), "options": EMBEDDED_OPTIONS or "attribute's defaults", "runs": runs,
            "store_bytes": size, "bytes_per_graph": size // len(store), "features_graph_0": graph.n_features,
            "nodes_graph_0": graph.n_nodes, "identical_stores": identical}


def random_runs(args, work: Path) -> dict:
    from benchmarks.attribution import random_arcee_8x1024, random_tokens, random_transcoders
    from hooked_models.attribution import attribute_dataset

    model = random_arcee_8x1024()
    transcoders = random_transcoders(model, 4096, 8)
    prompts = torch.cat([random_tokens(model, 32, seed=s) for s in range(args.random_prompts)])
    store, cpu, wall = timed(lambda: attribute_dataset(model, prompts, transcoders, work / "random", progress=False,
                                                       **RANDOM_OPTIONS))
    size = store_bytes(store.path)
    print(f"random 8 x 1024 Arcee, {len(store)} prompts of 32 tokens: {wall:.1f} s ({len(store) / wall:.3f} graphs/s); "
          f"{size / len(store) / 1024:.0f} KiB per graph")
    return {"prompts": len(store), "seq": 32, "d_transcoder": 4096, "k": 8, "options": RANDOM_OPTIONS,
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "graphs_per_s": round(len(store) / wall, 4),
            "store_bytes": size, "bytes_per_graph": size // len(store), "nodes_graph_0": store[0].n_nodes}


def memory_runs(args, work: Path) -> dict:
    peaks = {}
    for scale in (1, 4):
        n = args.memory_prompts * scale
        done = subprocess.run([sys.executable, __file__, "--child", str(n), str(work / f"memory-{scale}")],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            sys.exit(f"the {scale}x memory run failed (exit {done.returncode})")
        peaks[f"{scale}x"] = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = peaks["4x"]["peak_bytes"] / peaks["1x"]["peak_bytes"]
    for name, r in peaks.items():
        print(f"  memory {name}: {r['prompts']} prompts, peak {r['peak_bytes'] / 2**20:.1f} MiB "
              f"(after imports {r['baseline_bytes'] / 2**20:.1f} MiB)")
    print(f"  peak 4x / 1x: {ratio:.3f}")
    return {**peaks, "peak_ratio_4x_over_1x": round(ratio, 4)}


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    if args.child:
        return child(int(args.child[0]), args.child[1])
    record = Results(args.results)
    work = Path(tempfile.mkdtemp(prefix="attribution_dataset_bench_"))
    try:
        figures = {"embedded": embedded_runs(args, work), "random_arcee": random_runs(args, work),
                   "memory": memory_runs(args, work)}
        record.save(figures)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    if not any(a == "--child" for a in sys.argv):
        print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)")
