"""Training transcoders at AFM-4.5B's shape: measured on CPU, and the plan at full size.

    python benchmarks/train_transcoders_afm.py --single --threads 1     # one layer, 8,192 TopK features, streamed
    python benchmarks/train_transcoders_afm.py --sharded                # a 36-layer CLT over 2 gloo processes
    python benchmarks/train_transcoders_afm.py --plan                   # 81,920 features per layer on 80 GB GPUs
    python benchmarks/train_transcoders_afm.py --buffer --threads 1     # the streaming buffer's peak / its size

The model is the synthetic bfloat16 checkpoint of benchmarks/load_4_5b.py (AFM-4.5B's shape, random weights;
written to --dir if absent, ~9.2 GB, and kept). `HookedArcee.from_pretrained` leaves every weight in the
safetensors files' memory-mapped pages (page cache, shared by every process that loads the same files), so
the checkpoint counts in each process's resident memory (RssFile) but once in the machine's.

`--single`: `train_transcoders(model, dataset=tokens, config=TrainingConfig(layers=(L,), ...))` in a fresh
process, streamed (the model runs only up to layer L, through the shuffling buffer): peak resident and
anonymous memory against checkpoint + transcoder parameters + Adam state, CPU seconds of the model's forwards
and of the rest (the transcoder's steps), the FVU curve. `--sharded`: a cross-layer transcoder of every layer
at a reduced width, `layout="features"`, under torchrun with 2 processes (gloo), each loading the model
memory-mapped and streaming its half of every batch: each process's parameter and Adam bytes (read back from
its checkpoint file, `step-*/rank-{r}-of-2.pt`), its peak memory while training and after the trainer
gathers the whole transcoder at the end. The tokens are random ids (no dataset is available offline).
`--plan`: the figures of a full-size run (parameters counted from the transcoder classes built on the meta
device, Adam state, activations per token, the [tokens x features] bytes a step keeps for backward measured
on the trainer's own loss, 80 GB GPUs per layout), no model needed.

`--buffer`: the streaming buffer's peak anonymous memory against its size, on the embedded Arcee.

Results go to benchmarks/results/train_transcoders_afm.json, train_transcoders_afm_sharded.json,
train_transcoders_afm_plan.json and streaming_buffer.json; benchmarks/figures.py renders them into
docs/guide/training-at-scale.md (and the summary of benchmarks/README.md).
"""

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, memory, peak_anon_during  # noqa: E402
from hooked_models.families.arcee import AFM_4_5B  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = AFM_4_5B.with_(dtype=torch.bfloat16)
FULL_FEATURES = 32 * SHAPE.hidden_size  # 81,920: an expansion of 32, and 2^14 x 5 (shards evenly over 2^n GPUs)
# While backward runs, the float32 gradients of the [tokens features] tensors, beside what the loss kept for it.
BACKWARD_GRADIENT_BYTES = 4
# The measured runs' settings (each overridable on the command line); the plan predicts their memory too.
RUNS = {"single": dict(width=8192, k=32, steps=300, batch_tokens=256, buffer_tokens=16_384, seq=256, forward_batch=16),
        "sharded": dict(width=128, k=16, steps=8, batch_tokens=256, buffer_tokens=512, seq=128, forward_batch=2)}


# ------------------------------------------------------------------------------------------------ the plan
def transcoder_parameters(cross_layer: bool, features: int, activation: str = "topk") -> tuple[int, int]:
    """(parameters, of which trained) of one layer's transcoder or the cross-layer transcoder of every layer,
    `features` wide per layer, counted from the classes themselves built on the meta device."""
    from hooked_models.transcoders import CrossLayerTranscoder, Transcoder
    from hooked_models.transcoders.training import TrainingConfig
    from hooked_models.transcoders.training.init import module_activation

    config = TrainingConfig(d_transcoder=features, activation=activation,
                            k=1 if activation in ("topk", "batchtopk") else None)
    kind, k = module_activation(config)
    d = SHAPE.hidden_size
    with torch.device("meta"):
        module = (CrossLayerTranscoder(SHAPE.num_layers, d, features, activation=kind, k=k) if cross_layer
                  else Transcoder(d, features, activation=kind, k=k))
    total = sum(p.numel() for p in module.parameters())
    untrained = module.threshold.numel() if activation == "batchtopk" else 0  # a running mean, not Adam's
    return total, total - untrained


def saved_bytes_per_token_feature(cross_layer: bool) -> float:
    """Bytes the trainer's loss keeps for backward per token and feature of each layer (the [tokens features]
    tensors: pre-activations, activations, the TopK mask), measured with saved-tensor hooks on
    `objective.batch_loss` at two token counts and two widths of a small shape (weights not counted)."""
    from hooked_models.transcoders.identity import ModelIdentity
    from hooked_models.transcoders.training import TrainingConfig
    from hooked_models.transcoders.training.distributed import Layout, process_group
    from hooked_models.transcoders.training.objective import batch_loss
    from hooked_models.transcoders.training.state import Shard

    d, layers = 32, 4

    def saved(tokens: int, features: int) -> tuple[int, int]:
        kw = dict(cross_layer=True) if cross_layer else dict(layers=(1,))
        config = TrainingConfig(d_transcoder=features, activation="topk", k=8, batch_tokens=tokens, **kw)
        shard = Shard(ModelIdentity("arcee", d, layers), config, Layout("data", features))
        weights = {p.untyped_storage().data_ptr() for p in shard.module.parameters()}
        x, y = torch.randn(2, len(shard.layers), tokens, d).unbind()
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            batch_loss(shard, x, y, config, shard.layout, tokens)
        return sum(storages.values()), len(shard.layers)

    # saved = a·tokens·features + (terms in tokens or features alone): the mixed difference isolates a.
    with process_group(), torch.enable_grad():
        (s11, n), (s12, _), (s21, _), (s22, _) = (saved(t, f) for t in (64, 128) for f in (256, 512))
    return (s22 - s21 - s12 + s11) / (64 * 256 * n)


def process_bytes(cross_layer: bool, features: int, processes: int, layers: int, batch_tokens: int,
                  buffer_tokens: int, saved_per_token_feature: float, model: bool = True) -> dict:
    """One process's bytes, feature-sharded over `processes` (1: data layout in one process), training
    `layers` layers' per-layer transcoders (or the cross-layer transcoder of every layer)."""
    d = SHAPE.hidden_size
    shard = features // processes
    params, trained = transcoder_parameters(cross_layer, shard)
    params, trained = (params, trained) if cross_layer else (params * layers, trained * layers)
    whole, _ = transcoder_parameters(cross_layer, features)
    whole = whole if cross_layer else whole * layers
    n = SHAPE.num_layers if cross_layer else layers
    model_bytes = 2 * model_parameters() if model else 0
    out = {
        "model": model_bytes,
        "parameters": 4 * params,
        "gradients": 4 * trained,
        "adam": 2 * 4 * trained,  # exp_avg and exp_avg_sq, float32
        "batch": 2 * n * batch_tokens * d * 4,  # x and y, float32, the whole batch in every process
        # the [tokens features] tensors kept for backward, and their gradients (float32) while it runs
        "step_activations": int(batch_tokens * n * shard * (saved_per_token_feature + BACKWARD_GRADIENT_BYTES)),
    }
    out["device_total"] = sum(out.values())
    out["buffer_host"] = buffer_tokens // processes * n * 2 * d * 2  # bfloat16, in host memory (sources.py)
    # Shard.gathered(): the whole transcoders in every process (host memory), each tensor gathered on the device
    # first (the processes' parts, then their concatenation: twice the largest whole tensor, transient).
    out["gathered_at_end"] = 4 * whole
    largest = SHAPE.num_layers * d * features if cross_layer else d * features  # a CLT's W_enc, or its W_dec[0]
    transient = 2 * 4 * largest if processes > 1 else 0
    # on the device then: the training state, the last batch and its activations (the step's graph is gone)
    out["gather_device_peak"] = (out["device_total"] - out["step_activations"] + 4 * batch_tokens * n * shard
                                 + transient)
    return out


@functools.cache
def model_parameters() -> int:
    """AFM-4.5B's parameter count (its bfloat16 bytes are twice it: the checkpoint's tensors)."""
    from hooked_models import HookedArcee

    with torch.device("meta"):
        return sum(p.numel() for p in HookedArcee(SHAPE).parameters())


def smallest_processes(cross_layer: bool, features: int, layers: int, batch_tokens: int, buffer_tokens: int,
                       saved: float, budget: float) -> tuple[int | None, dict | None]:
    """The fewest processes (one per GPU) whose device bytes fit `budget`, among the counts the trainer accepts
    (they divide the features and the batch's tokens); None where none does."""
    counts = [p for p in range(1, features + 1) if features % p == 0 and batch_tokens % p == 0]
    for p in counts:
        b = process_bytes(cross_layer, features, p, layers, batch_tokens, buffer_tokens, saved)
        if b["device_total"] <= budget:
            return p, b
    return None, None


def plan(features: int = FULL_FEATURES, batch_tokens: int = 4096, buffer_tokens: int = 65_536,
         gpu_bytes: int = 80 * 2**30, usable: float = 0.9) -> dict:
    """The full-size plan: per-layer transcoders and a cross-layer transcoder of `features` per layer."""
    d, n = SHAPE.hidden_size, SHAPE.num_layers
    budget = usable * gpu_bytes
    saved = {"per_layer": saved_bytes_per_token_feature(False), "cross_layer": saved_bytes_per_token_feature(True)}
    one, one_trained = transcoder_parameters(False, features)
    clt, clt_trained = transcoder_parameters(True, features)
    from hooked_models.transcoders import CrossLayerTranscoder

    with torch.device("meta"):
        shapes = CrossLayerTranscoder(n, d, features, activation="topk", k=1)
        decoder = sum(w.numel() for w in shapes.W_dec)
        encoder = shapes.W_enc.numel()
    layouts = {}
    # Per-layer transcoders in the data layout: a process to a GPU trains as many layers (`layers=`) as fit.
    single = process_bytes(False, features, 1, 1, batch_tokens, buffer_tokens, saved["per_layer"])
    fit = int((budget - single["model"]) // (single["device_total"] - single["model"]))
    packed = process_bytes(False, features, 1, fit, batch_tokens, buffer_tokens, saved["per_layer"])
    layouts["per_layer_data"] = {"bytes": packed, "layers_per_gpu": fit, "gpus": math.ceil(n / fit)}
    for name, cross in (("per_layer_features", False), ("cross_layer_features", True)):
        key = "cross_layer" if cross else "per_layer"
        procs, b = smallest_processes(cross, features, n, batch_tokens, buffer_tokens, saved[key], budget)
        layouts[name] = {"gpus": procs, "bytes": b}
    whole = process_bytes(True, features, 1, n, batch_tokens, buffer_tokens, saved["cross_layer"])
    layouts["cross_layer_data"] = {"bytes": whole, "gpus": 1 if whole["device_total"] <= budget else None}
    # The same arithmetic for the two measured runs' processes (the model aside: it is memory-mapped, page cache).
    runs = {mode: process_bytes(mode == "sharded", run["width"], 2 if mode == "sharded" else 1, 1,
                                run["batch_tokens"], run["buffer_tokens"],
                                saved["cross_layer" if mode == "sharded" else "per_layer"], model=False)
            for mode, run in RUNS.items()}
    return {
        "features": features, "hidden_size": d, "layers": n, "batch_tokens": batch_tokens,
        "buffer_tokens": buffer_tokens, "gpu_bytes": gpu_bytes, "usable_fraction": usable,
        "model_bytes": single["model"],
        "per_layer": {"parameters": one, "trained": one_trained, "all_layers": n * one},
        "cross_layer": {"parameters": clt, "trained": clt_trained, "encoder": encoder, "decoder": decoder},
        "mlp_io_bytes_per_token": {"bfloat16": 2 * n * d * 2, "float32": 2 * n * d * 4},
        "saved_bytes_per_token_feature": saved, "backward_gradient_bytes_per_token_feature": BACKWARD_GRADIENT_BYTES,
        "layouts": layouts,
        "measured_runs_predicted": runs,
    }


def buffer_run(buffer_tokens: int = 1 << 18, batch_tokens: int = 4096, forward_batch: int = 512, seq: int = 64,
               refills: int = 3) -> dict:
    """The streaming buffer's memory against its nominal size: `StreamingSource` over the embedded Arcee (small
    forwards, so the buffer dominates), `refills` refills of half the buffer, the peak anonymous memory above
    the start and the bytes the stream holds afterwards."""
    import ctypes
    import gc

    from hooked_models.families import load_model as load_family
    from hooked_models.transcoders.training import StreamingSource

    model = load_family("embedded", "arcee")
    layers = list(range(model.cfg.num_layers))
    windows = (refills + 2) * buffer_tokens // seq
    tokens = torch.randint(3, model.cfg.vocab_size, (windows, seq), generator=torch.Generator().manual_seed(0))
    source = StreamingSource(model, tokens, layers, batch_tokens=batch_tokens, buffer_tokens=buffer_tokens,
                             forward_batch=forward_batch, streams=1, share=(0, 1), seed=0)
    nominal = buffer_tokens * 2 * len(layers) * model.cfg.hidden_size * model.cfg.dtype.itemsize
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = memory("RssAnon")
    steps = refills * (buffer_tokens // 2) // batch_tokens
    peak, cpu = peak_anon_during(lambda: [source.batch() for _ in range(steps)])
    held = sum(t.untyped_storage().nbytes() for stream in source.mine for t in (stream.buffer, stream.ready)
               if t is not None)
    return {"model": f"embedded Arcee ({len(layers)} layers x {model.cfg.hidden_size}, {model.cfg.dtype})",
            "buffer_tokens": buffer_tokens, "batch_tokens": batch_tokens, "forward_tokens": forward_batch * seq,
            "steps": steps, "nominal_bytes": nominal, "peak_anon_above_start": peak - start, "held_bytes": held,
            "peak_over_nominal": round((peak - start) / nominal, 3), "held_over_nominal": round(held / nominal, 3),
            "cpu_s": round(cpu, 1)}


# ------------------------------------------------------------------------------------------------ runs
def ensure_checkpoint(directory: Path) -> int:
    from benchmarks.load_4_5b import write_checkpoint

    if not (directory / "model.safetensors.index.json").exists():
        print(f"writing the synthetic AFM-4.5B checkpoint to {directory}", flush=True)
        write_checkpoint(SHAPE, directory)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def load_model(directory: Path):
    from hooked_models import HookedArcee

    model = HookedArcee.from_pretrained(directory, dtype=torch.bfloat16).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def memory_now() -> dict:
    """Resident memory now: all, anonymous, file-backed, the peak (VmHWM); and from smaps_rollup the pages this
    process shares with another (Shared_Clean: the checkpoint's, when two processes map it) and its
    proportional share of all (Pss: a page n processes map counts 1/n in each)."""
    rollup = {line.split(":")[0]: int(line.split()[1]) * 1024
              for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]}
    return {"rss": memory("VmRSS"), "anon": memory("RssAnon"), "file": memory("RssFile"), "peak_rss": memory("VmHWM"),
            "shared_clean": rollup["Shared_Clean"], "pss": rollup["Pss"]}


def random_windows(model, windows: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Random token ids [windows seq], each window opening with BOS (no dataset is available offline)."""
    tokens = torch.randint(3, model.cfg.vocab_size, (windows, seq), generator=torch.Generator().manual_seed(seed))
    bos = model.cfg.bos_token_id
    tokens[:, 0] = bos if bos is not None and bos < model.cfg.vocab_size else 1  # (a reduced test shape's vocab)
    return tokens


def timed_forwards() -> dict:
    """CPU seconds and tokens of the streaming source's model forwards (StreamingSource.activations)."""
    from hooked_models.transcoders.training import StreamingSource

    spent = {"cpu_s": 0.0, "tokens": 0}
    activations = StreamingSource.activations

    def timed(self, tokens):
        began = time.process_time()
        out = activations(self, tokens)
        spent["cpu_s"] += time.process_time() - began
        spent["tokens"] += tokens.numel()
        return out

    StreamingSource.activations = timed
    return spent


def child(args) -> dict:
    """One training process: load, train, measure (under torchrun: one of the feature-sharded processes)."""
    from benchmarks.attribution import reset_peak
    from hooked_models.transcoders.training import TrainingConfig, train_transcoders

    if args.threads:
        torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", 0))
    baseline = memory_now()
    began = time.process_time()
    model = load_model(args.dir)
    loaded = {**memory_now(), "cpu_s": round(time.process_time() - began, 1)}
    calls = [0] * model.cfg.num_layers
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda module, inputs, output, i=i: calls.__setitem__(i, calls[i] + 1))
    forwards = timed_forwards()
    sharded = args.mode == "sharded"
    config = TrainingConfig(
        d_transcoder=args.width, activation="topk", k=args.k, steps=args.steps, batch_tokens=args.batch_tokens,
        buffer_tokens=args.buffer_tokens, forward_batch=args.forward_batch, log_every=1 if sharded else 10,
        checkpoint_every=args.steps, **(dict(cross_layer=True, layout="features") if sharded
                                        else dict(layers=(args.layer,))))
    steps = []

    def progress(step) -> None:
        steps.append({"cpu_s": time.process_time() - began, **memory_now()})

    reset_peak()  # the peak from here is training's, not loading's
    before = memory_now()
    began = time.process_time()
    result = []
    peak_anon, cpu = peak_anon_during(lambda: result.append(train_transcoders(
        model, dataset=random_windows(model, args.windows, args.seq), config=config, checkpoint=args.work / "checkpoint",
        out=args.work / "out", progress=progress)))
    modules = result[0].values() if isinstance(result[0], dict) else [result[0]]  # {layer: Transcoder} or a CLT
    whole = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    return {"rank": rank, "baseline": baseline, "loaded": loaded, "before_training": before, "after": memory_now(),
            "peak_anon": peak_anon, "cpu_s": round(cpu, 1), "forward_cpu_s": round(forwards["cpu_s"], 1),
            "forward_tokens": forwards["tokens"], "layer_forward_calls": calls, "steps": steps,
            "result_parameter_bytes": whole, "torch_threads": torch.get_num_threads()}


def shard_bytes(checkpoint: Path) -> list[dict]:
    """Each process's checkpoint file: its parameters' and its Adam state's bytes."""
    out = []
    for file in sorted(checkpoint.glob("step-*/rank-*-of-*.pt")):
        state = torch.load(file, weights_only=True)
        params = sum(t.numel() * t.element_size() for t in state["shard"]["module"].values())
        adam = sum(t.numel() * t.element_size() for t in _leaves(state["optimizer"]["state"])
                   if isinstance(t, torch.Tensor) and t.ndim > 0)  # exp_avg, exp_avg_sq (not the step counts)
        out.append({"file": file.name, "file_bytes": file.stat().st_size, "parameter_bytes": params, "adam_bytes": adam})
    return out


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def run(args) -> dict:
    """The measured run (`--single` or `--sharded`) in fresh processes; returns its figures."""
    checkpoint_bytes = ensure_checkpoint(args.dir)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    forwarded = [a for a in sys.argv[1:] if a not in ("--single", "--sharded")]
    script = [str(Path(__file__).resolve()), "--child", args.mode, *forwarded]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.mode == "sharded":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    else:
        command = [sys.executable, *script]
    subprocess.run(command, env=env, check=True)
    ranks = [json.loads(p.read_text()) for p in sorted(args.work.glob("rank-*.json"))]
    report = json.loads((args.work / "out" / "training.json").read_text())
    shards = shard_bytes(args.work / "checkpoint")
    final = report["curves"][-1]
    figures = {
        "mode": args.mode, "checkpoint_bytes": checkpoint_bytes, "width": args.width, "k": args.k,
        "layer": None if args.mode == "sharded" else args.layer, "steps": args.steps,
        "batch_tokens": args.batch_tokens, "buffer_tokens": args.buffer_tokens, "seq": args.seq,
        "forward_batch": args.forward_batch,
        "windows": args.windows, "tokens": "random ids", "processes": len(ranks), "shards": shards,
        "fvu_first": report["curves"][0]["fvu"], "fvu_final": final["fvu"], "l0_final": final["l0"],
        "dead_pct_final": final["dead_pct"], "curve_tokens": [c["tokens"] for c in report["curves"]],
        "curve_fvu": [c["fvu"] for c in report["curves"]], "ranks": ranks,
    }
    if not args.keep_work:
        shutil.rmtree(args.work, ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--single", action="store_const", dest="mode", const="single")
    mode.add_argument("--sharded", action="store_const", dest="mode", const="sharded")
    mode.add_argument("--plan", action="store_const", dest="mode", const="plan")
    mode.add_argument("--buffer", action="store_const", dest="mode", const="buffer",
                      help="the streaming buffer's peak memory against its size (the embedded Arcee)")
    mode.add_argument("--child", choices=("single", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/afm_4_5b_train"), help="the synthetic checkpoint")
    parser.add_argument("--work", type=Path, default=Path("/tmp/afm_4_5b_train_work"))
    parser.add_argument("--keep-work", action="store_true", help="keep the checkpoints and the trained result")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument("--layer", type=int, default=3, help="--single: the layer trained")
    parser.add_argument("--width", type=int, default=None, help="features per layer (8,192; --sharded 128)")
    parser.add_argument("--k", type=int, default=None, help="TopK's k (32; --sharded 16)")
    parser.add_argument("--steps", type=int, default=None, help="(300; --sharded 8)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="(256; --sharded 256)")
    parser.add_argument("--buffer-tokens", type=int, default=None, help="(16,384; --sharded 512)")
    parser.add_argument("--forward-batch", type=int, default=None, help="windows per forward (16; --sharded 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per window (256; --sharded 128)")
    parser.add_argument("--windows", type=int, default=None, help="random windows (enough for one epoch)")
    parser.add_argument("--results", default=None, help="benchmarks/results/RESULTS.json (default: by mode)")
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
    for name, value in RUNS.get(args.mode, {}).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.mode in ("single", "sharded") and args.windows is None:
        args.windows = -(-(args.steps * args.batch_tokens + args.buffer_tokens) // args.seq) + args.forward_batch
    if args.child:
        figures = child(args)
        (args.work / f"rank-{figures['rank']}.json").write_text(json.dumps(figures))
        return
    name = args.results or {"single": "train_transcoders_afm", "sharded": "train_transcoders_afm_sharded",
                            "plan": "train_transcoders_afm_plan", "buffer": "streaming_buffer"}[args.mode]
    results = Results(name)
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = {"plan": plan, "buffer": buffer_run}.get(args.mode, lambda: run(args))()
    print(json.dumps({k: v for k, v in figures.items() if k not in ("ranks", "curve_fvu")}, indent=1)[:4000])
    results.save(figures)


if __name__ == "__main__":
    main()
