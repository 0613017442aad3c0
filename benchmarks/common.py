"""Shared pieces of the benchmarks: the benchmark model's shape, random non-trivial weights, and an
interleaved timer (each round runs every contender once, so drifting machine load hits all alike)."""

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


class Results:
    """One benchmark run's figures, written to `benchmarks/results/<name>.json`, the one source of every
    figure the READMEs quote (`benchmarks/figures.py` renders them; tests/test_benchmark_figures.py checks).

    Made when the run starts (the command and the load average then), saved when it ends, with the machine's
    state beside the figures: a shared machine's load stretches wall-clock time, not one thread's CPU time.
    """

    def __init__(self, name: str):
        self.name = name
        script = Path(sys.argv[0]).resolve()
        try:
            script = script.relative_to(Path(__file__).resolve().parents[1])
        except ValueError:
            pass
        self.command = shlex.join(["python", str(script), *sys.argv[1:]])
        self.load_before = os.getloadavg()
        self.started = time.perf_counter()

    def save(self, figures: dict) -> Path:
        from importlib.metadata import PackageNotFoundError, version

        def installed(package: str) -> str | None:
            try:
                return version(package)
            except PackageNotFoundError:
                return None

        record = {
            "benchmark": self.name,
            "command": self.command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "load_average_before": [round(x, 2) for x in self.load_before],
                        "load_average_after": [round(x, 2) for x in os.getloadavg()],
                        "python": platform.python_version()},
            "versions": {package: installed(package) for package in ("torch", "transformers", "transformer-lens")},
            "seconds": round(time.perf_counter() - self.started, 1),
            "figures": figures,
        }
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{self.name}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nresults written to {path}")
        return path


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def timings(medians: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """`interleaved`'s medians as JSON: {contender: {"cpu_s": ..., "wall_s": ...}}."""
    return {name: {"cpu_s": round(cpu, 6), "wall_s": round(wall, 6)} for name, (cpu, wall) in medians.items()}


def bench_args(description: str) -> argparse.Namespace:
    """The benchmark shape: an 8-layer, 1024-wide GQA Arcee, batch 4 x 256, float32 (issue #7)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--results", default=Path(sys.argv[0]).stem,
                        help="write the figures to benchmarks/results/RESULTS.json (default: %(default)s)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def hf_arcee_config(args, attn_implementation: str = "sdpa"):
    from transformers import ArceeConfig

    config = ArceeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 256,
                         "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config._attn_implementation = attn_implementation
    return config


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights, norm weights spread around 1 (as tests/conftest.py's `randomize_`), biases (a
    LayerNorm's too: alpha-er's) around 0."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(noise / max(p.shape[-1], 1) ** 0.5)
    return model


def interleaved(contenders: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> dict[str, tuple[float, float]]:
    """Median (CPU seconds, wall seconds) per call of each contender, run in turn within each round.

    CPU time of this process is the figure to compare on a shared machine: other processes stretch
    the wall clock but not it (run with --threads 1 for the steadiest ratios).
    """
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for round_ in range(warmup + rounds):
        for name, fn in contenders.items():
            gc.collect()
            cpu, wall = time.process_time(), time.perf_counter()
            out = fn()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            del out
            if round_ >= warmup:
                times[name].append((cpu, wall))
    return {name: (statistics.median(c for c, _ in ts), statistics.median(w for _, w in ts))
            for name, ts in times.items()}


def report(title: str, medians: dict[str, tuple[float, float]], baseline: str, target: str = "") -> None:
    print(f"\n{title}" + (f"  (target: {target})" if target else ""))
    base_cpu, base_wall = medians[baseline]
    for name, (cpu, wall) in medians.items():
        print(f"  {name:<40} cpu {cpu * 1000:9.1f} ms  {cpu / base_cpu:5.3f}x   "
              f"wall {wall * 1000:9.1f} ms  {wall / base_wall:5.3f}x")


def peak_anon_during(fn: Callable[[], object]) -> tuple[int, float]:
    """(the peak RssAnon while `fn` runs, sampled every 5 ms; its CPU seconds)."""
    import threading

    peak, running = [memory("RssAnon")], True

    def sample():
        while running:
            peak[0] = max(peak[0], memory("RssAnon"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.process_time()
    try:
        fn()
    finally:
        running = False
        sampler.join()
    return peak[0], time.process_time() - began


def memory(field: str) -> int:
    """Bytes of /proc/self/status's `field`: VmRSS now, VmHWM the peak of this process's own memory
    (getrusage's ru_maxrss would carry a parent's peak across the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)
