"""Side by side with EleutherAI's sparsify: training transcoders on the embedded Arcee, the same tokens in the
same order, and what each side's transcoders are worth on held-out prompts.

    bash .ci/sparsify-env.sh                                        # once: the side environment
    nice python benchmarks/transcoder_training.py --threads 1        # 3 seeds, then the k sweep

sparsify (1.3.3, PyPI `eai-sparsify`) is not installed beside this package, so each run is a child process:
- `--side sparsify` runs in the side environment .ci/sparsify-env (`bash .ci/sparsify-env.sh` builds it) and
  imports nothing of this package: it loads the embedded Arcee's directory with transformers'
  `ArceeForCausalLM`, trains with sparsify's Python API (`Trainer(TrainConfig(...), dataset, model).fit()`; its
  command line hard-codes a CUDA device map), lets sparsify save its transcoders (`sae.safetensors` per
  hookpoint), and measures their FVU on the held-out prompts with sparsify's own `SparseCoder.forward`.
- `--side ours` runs here: `train_ours`, our `train_transcoders` streamed over the same rows in order (no
  shuffling buffer), saved with `TranscoderSet.save`.
- The main half builds the token stream once, starts the runs (sides interleaved: sparsify's settings, then
  ours, seed by seed), converts sparsify's transcoders into our `TranscoderSet` (`from_sparsify`, checked
  against sparsify's own FVU), measures every run with the same `evaluate` and writes
  benchmarks/results/transcoder_training.json, from which benchmarks/figures.py renders the table and the
  FVU-against-L0 figure.

sparsify at its best: its learning rate is tuned first, on the first seed (ADAM_LRS, SIGNUM_LRS; `--adam-lr`,
`--signum-lr` skip it), by held-out FVU alone. Ours is tuned over the same grid on the same seed, at the same L0:
the lowest FVU among the lrs whose held-out L0 is at least that of sparsify's best on every layer (the issue
compares FVU "at the same L0": a TopK run whose L0 falls below k, as ours does at high lrs, buys its FVU with
fewer active features and, here, many dead ones), with OUR_RECIPE's AuxK weight and window and first-batch
encoder spread (sparsify runs with that AuxK too, and without, and keeps its best). Then every compared setting
(`compared_settings`: the issue's Adam at 2e-3 with its default warm-up among them) and ours train with every seed, and the k sweep runs
sparsify's best setting and ours. A run already made (the same side, setting, seed and k) is reused, not repeated.

The recipe (issue 31): transcoders of `layers.{0,1}.mlp` (sparsify's hookpoints: the module's input and
output, our `mlp_input` and `mlp.mlp_output`), 256 latents, TopK k=16 (sparsify's TopK of ReLU(pre) and our
ReLU of the top-k pre-activations are one function), 1,500 steps of 64 prompts (1,024 tokens). The tokens:
the 8,192 IOI prompts the shipped transcoders train on (`make_ioi_prompts(4096, 3_000_000)`, clean and
corrupted), one seeded permutation after another to 1,500 x 64 rows; sparsify's Trainer reads a dataset's rows
in order (it never shuffles), so batch i is rows 64i ... 64i+63. Held out: `make_ioi_prompts(512, 8)`'s clean
prompts (8,192 tokens). Figures: FVU (Σ|y-ŷ|² / Σ|y-ȳ|² over every held-out position, sparsify's definition),
L0 and dead % (features that never fire on the held-out tokens) per layer, loss recovered and KL divergence
of the replacement model (every MLP replaced; `hooked_models.transcoders.evaluate` for both sides), and the CPU seconds of each child's training call alone (not
loading the model or the tokens), one thread, per 1,000 training tokens.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIDE_PYTHON = ROOT / ".ci" / "sparsify-env" / "bin" / "python"
HOOKPOINTS = ["layers.0.mlp", "layers.1.mlp"]  # sparsify's names under ArceeForCausalLM.model

D_TRANSCODER, K, STEPS, BATCH_PROMPTS, LR = 256, 16, 1500, 64, 2e-3
TRAIN_PROMPTS, TRAIN_SEED = 4096, 3_000_000  # hooked_models/embedded/train_transcoders.py's
HELD_OUT_PROMPTS, HELD_OUT_SEED = 512, 8
STREAM_SEED = 0

# sparsify at its best: its learning rate tuned on the first seed (k=16) over these grids, by held-out FVU (the
# geometric mean over layers), Adam without warm-up (its default warm-up, 1,000 steps, is most of a 1,500-step
# run: it trained worse at each lr tried, 2e-3 and 8e-3, and so did 100 steps), Signum (its default optimizer,
# schedule-free) from below its default lr, 5e-3 / sqrt(latents / 2^14) = 0.04. Ad hoc trials on seed 0 put
# Adam's best between 8e-3 and 3.2e-2 and Signum's near 5e-3: both grids bracket them.
ADAM_LRS = (2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2)
SIGNUM_LRS = (2.5e-3, 5e-3, 1e-2, None)  # None: its default
OUR_LRS = ADAM_LRS  # ours at its best: tuned over the same grid, on the same seed, interleaved with sparsify's
# AuxK needs a dead threshold the run can reach: its default, 10 M tokens, is longer than the run's 1.5 M. Its
# loss is the part of the error the dead features could explain, over the output's variance: at this recipe's
# FVU (about 1e-3, far below the errors of the large models Gao et al. chose 1/32 for) its gradient is that
# much weaker, so a larger weight is tried too. Ours trains with the larger one and with its encoder columns
# spread alike on the first batch (OUR_RECIPE: in trials on three seeds the two left fewer features dead on the
# held-out prompts, FVU no worse); sparsify runs without AuxK and with that AuxK (and with 1/32, but for --brief)
# and keeps its best (it has no first-batch spread).
AUXK = {"auxk_alpha": 1 / 32, "dead_feature_threshold": 100_000}
STRONG_AUXK = {"auxk_alpha": 1 / 2, "dead_feature_threshold": 100_000}
OUR_RECIPE = {"auxk_alpha": STRONG_AUXK["auxk_alpha"], "dead_tokens": STRONG_AUXK["dead_feature_threshold"],
              "init_spread": "equal"}


def auxk_name(alpha: float, window: int) -> str:
    return f"AuxK {Fraction(alpha).limit_denominator(1000)} over {window // 1000}k tokens"


def adam(lr: float, **more) -> tuple[str, dict]:
    """(name, TrainConfig fields) of sparsify's Adam at `lr`, no warm-up unless `more` says."""
    warmup = more.get("lr_warmup_steps", 0)
    name = f"Adam, lr {lr:g}, " + (f"warm-up {warmup:,}" if warmup else "no warm-up")
    name += f", {auxk_name(more['auxk_alpha'], more['dead_feature_threshold'])}" if "auxk_alpha" in more else ""
    return name, {"optimizer": "adam", "lr": lr, "lr_warmup_steps": 0, **more}


def signum(lr: float | None) -> tuple[str, dict]:
    return ("Signum, its default lr" if lr is None else f"Signum, lr {lr:g}",
            {"optimizer": "signum", **({} if lr is None else {"lr": lr})})


def compared_settings(adam_lr: float, signum_lr: float | None, brief: bool = False) -> dict[str, dict]:
    """The settings run with every seed: the issue's (Adam at 2e-3 with its default warm-up), Adam at its tuned
    lr without AuxK and with both AuxK weights, Signum at its default and at its tuned lr; `brief`: Adam at its
    tuned lr without AuxK and with ours."""
    if brief:
        return dict([adam(adam_lr), adam(adam_lr, **STRONG_AUXK)])
    return dict([adam(LR, lr_warmup_steps=1000), adam(adam_lr), adam(adam_lr, **AUXK), adam(adam_lr, **STRONG_AUXK),
                 signum(None), signum(signum_lr)])


def ours(lr: float, cross_layer: bool = False, default: bool = False) -> tuple[str, dict]:
    """(name, train_ours settings) of our trainer at `lr`: per-layer transcoders, or one cross-layer; with
    OUR_RECIPE unless `default` (TrainingConfig's defaults but for the recipe's and the lr)."""
    name = ("`train_transcoders`, cross-layer, " if cross_layer else "`train_transcoders`, ") + f"lr {lr:g}"
    if default:
        return name + " (its defaults)", {"lr": lr, "cross_layer": cross_layer}
    return (name + f", {auxk_name(OUR_RECIPE['auxk_alpha'], OUR_RECIPE['dead_tokens'])}, encoder spread equal",
            {"lr": lr, "cross_layer": cross_layer, **OUR_RECIPE})


def our_settings(lr: float) -> dict[str, dict]:
    """Ours with every seed: at its defaults (its default lr), at its tuned lr, and a cross-layer transcoder at
    that lr (k per layer, so the same total L0 as the per-layer pair)."""
    from hooked_models.transcoders import TrainingConfig

    return dict([ours(TrainingConfig.lr, default=True), ours(lr), ours(lr, cross_layer=True)])


def training_stream(corpus: torch.Tensor, rows: int, seed: int = STREAM_SEED) -> torch.Tensor:
    """[rows seq]: the corpus's rows, one seeded permutation of them after another (both sides' batches)."""
    generator = torch.Generator().manual_seed(seed)
    epochs = -(-rows // len(corpus))
    return corpus[torch.cat([torch.randperm(len(corpus), generator=generator) for _ in range(epochs)])[:rows]]


def timed(fn) -> tuple[object, float, float]:
    """fn's result, its CPU seconds (this process) and wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


# ------------------------------------------------------------------------------------ the sparsify side
def train_sparsify(model, tokens_in_order: torch.Tensor, seed: int, k: int, setting: dict, save_dir: Path) -> None:
    """sparsify's transcoders of HOOKPOINTS trained on `tokens_in_order` [rows seq], batches of BATCH_PROMPTS rows
    in order; it saves them under save_dir/run/<hookpoint>/. (Side environment.)"""
    from datasets import Dataset
    from sparsify import Trainer, TrainConfig, TranscoderConfig

    dataset = Dataset.from_dict({"input_ids": tokens_in_order.tolist()}).with_format("torch")
    config = TrainConfig(TranscoderConfig(num_latents=D_TRANSCODER, k=k), batch_size=BATCH_PROMPTS,
                         hookpoints=list(HOOKPOINTS), init_seeds=[seed], log_to_wandb=False, save_dir=str(save_dir),
                         run_name="run", save_every=10**9, **setting)
    trainer = Trainer(config, dataset, model)
    trainer.fit()


def sparsify_fvu(model, save_dir: Path, held_out: torch.Tensor) -> list[float]:
    """sparsify's own FVU of its saved transcoders on the held-out prompts (every position). (Side environment.)"""
    from sparsify import SparseCoder

    io = {}
    handles = [model.model.get_submodule(h).register_forward_hook(
        lambda module, args, out, h=h: io.__setitem__(h, (args[0].flatten(0, 1), out.flatten(0, 1))))
        for h in HOOKPOINTS]
    with torch.no_grad():
        model(held_out)
        for handle in handles:
            handle.remove()
        return [float(SparseCoder.load_from_disk(save_dir / "run" / h).forward(*io[h]).fvu) for h in HOOKPOINTS]


def side_sparsify(args) -> None:
    from importlib.metadata import version

    from safetensors.torch import load_file
    from transformers import ArceeForCausalLM

    tokens = load_file(str(args.tokens))
    model = ArceeForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    _, cpu, wall = timed(lambda: train_sparsify(model, tokens["stream"], args.seed, args.k, json.loads(args.setting),
                                                args.out))
    record = {"cpu_s": cpu, "wall_s": wall, "threads": torch.get_num_threads(),
              "fvu_sparsify": sparsify_fvu(model, args.out, tokens["held_out"]),
              "versions": {p: version(p) for p in ("eai-sparsify", "torch", "transformers", "schedulefree")}}
    (args.out / "run.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------------------ our side
def train_ours(model, tokens_in_order: torch.Tensor, seed: int, k: int, lr: float = LR, cross_layer: bool = False,
               **more):
    """Our transcoders of every layer (TrainingConfig's defaults but for the recipe's and these settings, `more`
    among them: TrainingConfig fields),
    streamed from the model over `tokens_in_order` [rows seq] without a shuffling buffer, so that batch i is
    rows 64i ... 64i+63, as sparsify's is, and the model run on each batch at once, as sparsify runs it."""
    from hooked_models.transcoders import TrainingConfig, train_transcoders

    rows, seq = tokens_in_order.shape
    config = TrainingConfig(d_transcoder=D_TRANSCODER, activation="topk", k=k, steps=rows // BATCH_PROMPTS,
                            batch_tokens=BATCH_PROMPTS * seq, lr=lr, seed=seed, buffer_tokens=0,
                            forward_batch=BATCH_PROMPTS, cross_layer=cross_layer, **more)
    return train_transcoders(model, dataset=tokens_in_order, config=config, progress=False)


def side_ours(args) -> None:
    from safetensors.torch import load_file

    from hooked_models.families import load_model

    tokens = load_file(str(args.tokens))
    model = load_model("embedded", family="arcee")
    setting = json.loads(args.setting)
    transcoders, cpu, wall = timed(lambda: train_ours(model, tokens["stream"], args.seed, args.k, **setting))
    transcoders.save(args.out / "transcoders")
    (args.out / "run.json").write_text(json.dumps({"cpu_s": cpu, "wall_s": wall, "threads": torch.get_num_threads()}))


# ------------------------------------------------------------------------------------ the main half
def from_sparsify(directory: Path, model):
    """sparsify's saved per-hookpoint transcoders (encoder.weight [latents d_in], encoder.bias, W_dec [latents
    d_out], b_dec; cfg.json) as our TranscoderSet (W_enc [d_in d_transcoder]): TopK ones without a skip only."""
    from safetensors.torch import load_file

    from hooked_models.transcoders import Transcoder, TranscoderSet

    layers = []
    for layer, hookpoint in enumerate(HOOKPOINTS):
        config = json.loads((directory / hookpoint / "cfg.json").read_text())
        if config["activation"] != "topk" or config["skip_connection"] or not config["transcode"]:
            raise ValueError(f"{directory / hookpoint}: a {config['activation']} coder (skip connection "
                             f"{config['skip_connection']}, transcode {config['transcode']}); this converts TopK "
                             "transcoders without a skip connection")
        state = load_file(str(directory / hookpoint / "sae.safetensors"))
        if set(state) != {"encoder.weight", "encoder.bias", "W_dec", "b_dec"}:
            raise ValueError(f"{directory / hookpoint}: tensors {sorted(state)}")
        d_transcoder, d_in = state["encoder.weight"].shape
        tc = Transcoder(d_in, d_transcoder, state["W_dec"].shape[1], layer=layer, activation="topk", k=config["k"])
        with torch.no_grad():
            tc.W_enc.copy_(state["encoder.weight"].T)
            tc.b_enc.copy_(state["encoder.bias"])
            tc.W_dec.copy_(state["W_dec"])
            tc.b_dec.copy_(state["b_dec"])
        layers.append(tc)
    return TranscoderSet(layers, model=model)


def evaluate(model, transcoders, tokens: torch.Tensor) -> dict:
    """Both sides' held-out figures, by `hooked_models.transcoders.evaluate`: per layer FVU (sparsify's
    definition), L0 and dead % (features active on no token); the replacement model's loss recovered, loss gap
    and KL divergence from the model."""
    from hooked_models.transcoders import evaluate as evaluate_transcoders

    report = evaluate_transcoders(model, transcoders, tokens)
    return {"fvu": report["fvu"], "l0": report["l0"], "dead_pct": report["dead_percent"],
            "loss_recovered": report["loss_recovered"], "loss_gap": report["loss_gap"],
            "kl_divergence": report["kl_divergence"]}


def run_side(args, side: str, tokens_file: Path, seed: int, k: int, name: str | None = None,
             setting: dict | None = None) -> dict:
    """One training run in its own process (`name`, `setting`: sparsify's); its figures on the held-out prompts.
    A run already made (args.done: the same side, setting, seed and k) is not repeated."""
    key = json.dumps([side, setting, seed, k], sort_keys=True)
    if key in args.done:
        return {**args.done[key], "setting": name}
    from hooked_models.embedded import embedded_checkpoint
    from hooked_models.transcoders import load_transcoders

    with tempfile.TemporaryDirectory(prefix=f"{side}-") as out:
        out = Path(out)
        command = ["--side", side, "--tokens", str(tokens_file), "--seed", str(seed), "--k", str(k), "--out", str(out),
                   "--threads", str(args.threads or torch.get_num_threads()), "--setting", json.dumps(setting)]
        if side == "sparsify":
            command = [str(args.side_python), __file__, *command, "--model", str(embedded_checkpoint("arcee"))]
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the side's own packages only
        else:
            command = [sys.executable, __file__, *command]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode:
            raise RuntimeError(f"the {side} run failed:\n{done.stdout[-4000:]}")
        record = json.loads((out / "run.json").read_text())
        transcoders = (from_sparsify(out / "run", args.model) if side == "sparsify"
                       else load_transcoders(out / "transcoders", model=args.model))
        figures = evaluate(args.model, transcoders, args.held_out)
    run = {"side": side, "setting": name, "k": k, "seed": seed, **figures,
           "cpu_s": round(record["cpu_s"], 2), "wall_s": round(record["wall_s"], 2), "threads": record["threads"],
           "cpu_s_per_1k_tokens": record["cpu_s"] / args.train_tokens * 1000}
    if side == "sparsify":
        # The conversion is checked: our evaluation of the converted set against sparsify's own FVU.
        run["fvu_sparsify_own"] = record["fvu_sparsify"]
        run["fvu_conversion_rel_diff"] = max(abs(a - b) / b for a, b in zip(figures["fvu"], record["fvu_sparsify"]))
        args.sparsify_versions = record["versions"]
    args.done[key] = run
    print(f"  {side:8} {name or '':36} k {k:2} seed {seed}: FVU {fmt(run['fvu'], 5)}  L0 {fmt(run['l0'], 1)}  "
          f"dead % {fmt(run['dead_pct'], 1)}  loss recovered {run['loss_recovered']:.5f}  "
          f"CPU {run['cpu_s']:.1f} s ({run['cpu_s_per_1k_tokens']:.4f} s / 1k tokens)"
          + (f"; sparsify's own FVU within {run['fvu_conversion_rel_diff']:.1e}" if side == "sparsify" else ""), flush=True)
    return run


def fmt(values: list[float], digits: int) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def mean_sd(runs: list[dict]) -> dict:
    """Each figure's mean and sample standard deviation over the runs (seeds), per layer where it is per layer."""
    def stats(values):
        return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None}

    out = {"seeds": [r["seed"] for r in runs]}
    for key in ("fvu", "l0", "dead_pct"):
        out[key] = [stats([r[key][l] for r in runs]) for l in range(len(runs[0][key]))]
    for key in ("loss_recovered", "kl_divergence", "cpu_s_per_1k_tokens"):
        out[key] = stats([r[key] for r in runs])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["sparsify", "ours"], help="one training run (a child process)")
    parser.add_argument("--tokens", type=Path, help="(--side) the stream and held-out tokens (safetensors)")
    parser.add_argument("--model", type=Path, help="(--side sparsify) the model's directory")
    parser.add_argument("--setting", help="(--side) sparsify's TrainConfig fields, or train_ours's settings, as JSON")
    parser.add_argument("--out", type=Path, help="(--side) where the run writes its transcoders and run.json")
    parser.add_argument("--seed", type=int, default=0, help="(--side) the initialization's seed")
    parser.add_argument("--k", type=int, default=K, help="(--side) TopK's k")
    parser.add_argument("--side-python", type=Path, default=SIDE_PYTHON,
                        help="the side environment's python (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="initialization seeds, both sides")
    parser.add_argument("--adam-lr", type=float, help="sparsify's Adam lr (default: tuned over ADAM_LRS on the first seed)")
    parser.add_argument("--our-lr", type=float, help="our lr (default: tuned over OUR_LRS on the first seed)")
    parser.add_argument("--signum-lr", type=lambda v: None if v == "default" else float(v), default=float("nan"),
                        help="sparsify's Signum lr, or 'default' (default: tuned over SIGNUM_LRS on the first seed)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--brief", action="store_true",
                        help="sparsify's tuned Adam alone with every seed (with --adam-lr: a shorter run on a busy machine)")
    parser.add_argument("--ks", type=int, nargs="*", default=[8, 16, 32, 64],
                        help="the k sweep, both sides (k=16 reuses the runs above)")
    parser.add_argument("--sweep-seeds", type=int, nargs="*", help="the k sweep's seeds (default: --seeds)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, every run (default: torch's)")
    parser.add_argument("--results", default="transcoder_training",
                        help="write benchmarks/results/RESULTS.json (default: %(default)s)")
    args = parser.parse_args()
    args.sweep_seeds = args.seeds if args.sweep_seeds is None else args.sweep_seeds
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.side == "sparsify":
        return side_sparsify(args)
    sys.path.insert(0, str(ROOT))
    if args.side == "ours":
        return side_ours(args)

    from safetensors.torch import save_file

    from benchmarks.common import Results
    from hooked_models.embedded.task import make_ioi_prompts
    from hooked_models.families import load_model

    if not args.side_python.exists():
        raise FileNotFoundError(f"{args.side_python} not found: build the side environment with "
                                "`bash .ci/sparsify-env.sh`")
    results = Results(args.results)
    prompts = make_ioi_prompts(TRAIN_PROMPTS, TRAIN_SEED)
    corpus = torch.cat([prompts.clean_tokens, prompts.corrupted_tokens])
    stream = training_stream(corpus, args.steps * BATCH_PROMPTS)
    args.train_tokens = stream.numel()
    args.held_out = make_ioi_prompts(HELD_OUT_PROMPTS, HELD_OUT_SEED).clean_tokens
    args.model = load_model("embedded", family="arcee")
    args.done = {}
    with tempfile.TemporaryDirectory(prefix="transcoder-training-") as tmp:
        tokens_file = Path(tmp) / "tokens.safetensors"
        save_file({"stream": stream.contiguous(), "held_out": args.held_out.contiguous()}, str(tokens_file))

        def best(runs: list[dict]) -> str:  # the setting of the lowest FVU (geometric mean over layers and seeds)
            names = {r["setting"] for r in runs}
            return min(names, key=lambda n: statistics.geometric_mean(
                [fvu for r in runs if r["setting"] == n for fvu in r["fvu"]]))

        # Each side's lr tuned on the first seed, lr by lr: sparsify's Adam then ours, then sparsify's Signum.
        tuning, seed = [], args.seeds[0]
        print(f"tuning the lr: seed {seed}, k={K}", flush=True)
        grids = {"adam": [adam(lr) for lr in ADAM_LRS] if args.adam_lr is None else [],
                 "ours": [ours(lr) for lr in OUR_LRS] if args.our_lr is None else []}
        pairs = [(side, named) for i in range(max(map(len, grids.values())))
                 for side, grid in (("sparsify", grids["adam"]), ("ours", grids["ours"])) if i < len(grid)
                 for named in [grid[i]]]
        if args.signum_lr != args.signum_lr:  # nan: not given
            pairs += [("sparsify", named) for named in [signum(lr) for lr in SIGNUM_LRS]]
        tuning = [run_side(args, side, tokens_file, seed, K, *named) for side, named in pairs]
        for kind, of in (("adam", lambda r: r["side"] == "sparsify" and "Adam" in r["setting"]),
                         ("signum", lambda r: r["side"] == "sparsify" and "Signum" in r["setting"])):
            runs = [r for r in tuning if of(r)]
            if runs:
                setattr(args, f"{kind}_lr", {n: v for side, (n, v) in pairs}[best(runs)].get("lr"))
        # Ours at sparsify's L0: its best Adam setting's L0 on this seed (that run is reused in the seeds below).
        anchor = run_side(args, "sparsify", tokens_file, seed, K, *adam(args.adam_lr))
        ours_runs = [r for r in tuning if r["side"] == "ours"]
        if ours_runs:
            matched = [r for r in ours_runs if all(o >= t for o, t in zip(r["l0"], anchor["l0"]))]
            chosen = best(matched or ours_runs)
            args.our_lr = {n: v for side, (n, v) in pairs}[chosen]["lr"]
            print(f"ours at sparsify's L0 ({fmt(anchor['l0'], 2)}): {chosen}", flush=True)
        settings = compared_settings(args.adam_lr, args.signum_lr, args.brief)
        mine = our_settings(args.our_lr)
        print(f"k={K}, seeds {args.seeds}: sparsify's settings then ours, seed by seed", flush=True)
        runs = []
        for seed in args.seeds:
            runs += [run_side(args, "sparsify", tokens_file, seed, K, *s) for s in settings.items()]
            runs += [run_side(args, "ours", tokens_file, seed, K, *s) for s in mine.items()]
        sparsify_runs = [r for r in runs if r["side"] == "sparsify"]
        overall = best(sparsify_runs)
        best_adam = best([r for r in sparsify_runs if settings[r["setting"]]["optimizer"] == "adam"])
        our_best = ours(args.our_lr)[0]
        print(f"sparsify's best: {overall}; with Adam: {best_adam}; ours: {our_best}. The k sweep {args.ks}, "
              f"seeds {args.sweep_seeds}", flush=True)
        sweep = [run_side(args, side, tokens_file, seed, k, *named)
                 for seed in args.sweep_seeds for k in args.ks
                 for side, named in (("sparsify", (overall, settings[overall])), ("ours", (our_best, mine[our_best])))]
    summary = {name: mean_sd([r for r in runs if r["setting"] == name]) for name in [*settings, *mine]}

    def brief_run(run: dict) -> dict:
        return {key: run[key] for key in brief if key in run}

    brief = ("side", "setting", "k", "seed", "fvu", "l0", "dead_pct", "loss_recovered", "kl_divergence",
             "cpu_s_per_1k_tokens", "fvu_conversion_rel_diff")
    results.save({
        "recipe": {"model": "embedded Arcee (2 layers, hidden 64)", "hookpoints": HOOKPOINTS,
                   "d_transcoder": D_TRANSCODER, "k": K, "steps": args.steps, "batch_prompts": BATCH_PROMPTS,
                   "batch_tokens": BATCH_PROMPTS * stream.shape[1], "lr": LR},
        "stream": {"corpus": f"make_ioi_prompts({TRAIN_PROMPTS}, {TRAIN_SEED}), clean and corrupted",
                   "prompts": len(corpus), "rows": len(stream), "tokens": int(stream.numel()), "seed": STREAM_SEED},
        "held_out": {"corpus": f"make_ioi_prompts({HELD_OUT_PROMPTS}, {HELD_OUT_SEED}).clean_tokens",
                     "tokens": int(args.held_out.numel())},
        "sparsify_versions": args.sparsify_versions,
        "tuning": {"seed": args.seeds[0], "k": K, "runs": [brief_run(r) for r in tuning],
                   "our_rule": "the lowest FVU among our lrs whose held-out L0 is at least sparsify's best's on "
                               "every layer (seed 0)"},
        "sparsify_settings": settings, "sparsify_best": overall, "sparsify_best_adam": best_adam,
        "our_settings": mine, "our_best": our_best, "our_clt": ours(args.our_lr, cross_layer=True)[0],
        "runs": runs, "summary": summary,
        "sweep": {"setting": overall, "seeds": args.sweep_seeds, "ks": args.ks,
                  "runs": [brief_run(r) for r in sweep]},
    })


if __name__ == "__main__":
    main()
