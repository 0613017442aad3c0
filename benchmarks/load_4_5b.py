"""Loading at real scale: a synthetic checkpoint of AFM-4.5B's exact shape, loaded with
HookedArcee.from_pretrained in a child process that reports its peak resident memory.

    python benchmarks/load_4_5b.py                      # writes /tmp/afm_4_5b_synthetic (~9.3 GB), loads it, deletes it
    python benchmarks/load_4_5b.py --keep               # keep the checkpoint for a rerun
    python benchmarks/load_4_5b.py --layers 2 --hidden 256 --intermediate 1024 --vocab 4096 --heads 4 --kv-heads 2 --head-dim 64

The checkpoint is AFM-4.5B's shape (36 layers, 2560 wide, 20/4 heads of 128, MLP 18432, vocab
128004, untied, bfloat16) in safetensors shards with an index, random weights. It is written shard by
shard, so the writer never holds more than one shard. Target: peak RSS of the loading process
<= 1.15x the checkpoint's size. The child then runs a short bfloat16 forward on the CPU. The figures go
to benchmarks/results/load_4_5b.json.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, memory  # noqa: E402
from hooked_models.families.arcee import AFM_4_5B  # noqa: E402
from weight_conversion.arcee import hf_config_dict  # noqa: E402


def layer_tensors(cfg, i: int) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes for layer i."""
    p, d, h, kv, hd, m = f"model.layers.{i}.", cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, \
        cfg.intermediate_size
    return {
        p + "input_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (h * hd, d),
        p + "self_attn.k_proj.weight": (kv * hd, d),
        p + "self_attn.v_proj.weight": (kv * hd, d),
        p + "self_attn.o_proj.weight": (d, h * hd),
        p + "post_attention_layernorm.weight": (d,),
        p + "mlp.up_proj.weight": (m, d),
        p + "mlp.down_proj.weight": (d, m),
    }


def write_checkpoint(cfg, directory: Path, shard_bytes: int = 2 * 10**9) -> int:
    """Random bfloat16 weights of cfg's shape, sharded as transformers writes them; returns total bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2))
    groups = [{"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}]
    groups += [layer_tensors(cfg, i) for i in range(cfg.num_layers)]
    groups += [{"model.norm.weight": (cfg.hidden_size,), "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}]
    # Plan the shards first (names only), so each file's name knows the shard count.
    shards, size = [[]], 0
    for group in groups:
        for name, shape in group.items():
            nbytes = 2 * int(torch.Size(shape).numel())
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, shape))
            size += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                tensors[name] = (1 + 0.3 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
            else:
                tensors[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0, shape[-1] ** -0.5,
                                                                                  generator=generator)
            total += tensors[name].numel() * 2
            weight_map[name] = file
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
        print(f"  wrote {file}", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def child(directory: str) -> None:
    """Load, report peak RSS and load time as JSON on stdout's last line, run a short forward."""
    from hooked_models import HookedArcee

    baseline = memory("VmRSS")
    start = time.perf_counter()
    model = HookedArcee.from_pretrained(directory, dtype=torch.bfloat16, progress=True)
    load_s = time.perf_counter() - start
    peak_load = memory("VmHWM")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(tokens)
    forward_s = time.perf_counter() - start
    print(json.dumps(dict(
        baseline_rss=baseline, peak_rss_after_load=peak_load, load_s=load_s, param_bytes=params,
        forward_s=forward_s, logits_dtype=str(logits.dtype), logits_shape=list(logits.shape),
        logits_finite=bool(torch.isfinite(logits).all()),
        peak_rss_after_forward=memory("VmHWM"),
    )))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/afm_4_5b_synthetic")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    for name, default in [("layers", 36), ("hidden", 2560), ("heads", 20), ("kv-heads", 4), ("head-dim", 128),
                          ("intermediate", 18432), ("vocab", 128004)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--results", default="load_4_5b",
                        help="write the figures to benchmarks/results/RESULTS.json (default: %(default)s)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.dir)
    record = Results(args.results)

    cfg = AFM_4_5B.with_(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
                         vocab_size=args.vocab, dtype=torch.bfloat16)
    directory = Path(args.dir)
    try:
        if not (directory / "model.safetensors.index.json").exists():
            print(f"writing a synthetic checkpoint of shape {cfg.num_layers} layers x {cfg.hidden_size}, "
                  f"vocab {cfg.vocab_size}, to {directory}", flush=True)
            start = time.perf_counter()
            write_checkpoint(cfg, directory)
            print(f"  written in {time.perf_counter() - start:.0f} s", flush=True)
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        shards = len(list(directory.glob("*.safetensors")))
        # A fresh interpreter, so the peak is the loader's alone; stderr passes through (the progress bar).
        result = subprocess.run([sys.executable, __file__, "--child", "--dir", str(directory)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(
                                    Path(__file__).resolve().parents[1])})
        if result.returncode:
            sys.exit(f"the loading process failed (exit {result.returncode})")
        r = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    gb = 1e9
    print(f"\ncheckpoint: {size / gb:.2f} GB in {len(list(directory.glob('*.safetensors'))) or 'deleted'} shards"
          if args.keep else f"\ncheckpoint: {size / gb:.2f} GB (deleted)")
    print(f"load time: {r['load_s']:.1f} s; parameters in memory: {r['param_bytes'] / gb:.2f} GB")
    print(f"peak RSS of the loading process: {r['peak_rss_after_load'] / gb:.2f} GB = "
          f"{r['peak_rss_after_load'] / size:.3f}x the checkpoint (target <= 1.15x); "
          f"interpreter + imports before loading: {r['baseline_rss'] / gb:.2f} GB")
    print(f"bfloat16 forward of 1 x 16 tokens: {r['forward_s']:.1f} s, logits {r['logits_dtype']} "
          f"{r['logits_shape']}, finite: {r['logits_finite']}; peak RSS after it "
          f"{r['peak_rss_after_forward'] / gb:.2f} GB")
    record.save({"checkpoint_bytes": size, "shards": shards, **r})


if __name__ == "__main__":
    main()
