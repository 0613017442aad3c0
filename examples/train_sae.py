"""Train a sparse autoencoder with SAELens on a hooked model, evaluate it, and read its features.

    python -m venv sae-env && sae-env/bin/pip install torch==2.13.0 && sae-env/bin/pip install -e ".[dev,sae]"
    sae-env/bin/python examples/train_sae.py    # the embedded IOI model: trains in seconds on a CPU
    python examples/train_sae.py --family alpha-er --hook blocks.0.attn.hook_z --save out/sae

SAELens's own training runner trains the SAE at --hook (a standard or TransformerLens name) on the
model's activations; its evals report the reconstruction and the next-token loss with the SAE spliced
in. Then the SAE is spliced with `model.add_sae` to read, on held-out prompts, which tokens each of a
few features fires on, and a figure shows the features' density and where they fire.

SAELens needs TransformerLens 3.x, so it lives in an environment of its own (as CI's .ci/run makes one):
installing the `sae` extra beside the `dev` one of the Quick start would downgrade TransformerLens 4.x.
"""

import logging
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from common import arguments, load_model, make_task, out_path

os.environ.setdefault("WANDB_MODE", "disabled")


def training_tokens(model, rows: int, seed: int) -> torch.Tensor:
    """Prompts to train on: IOI sentences of every template for the embedded vocabulary, else the
    task's prompts (clean and corrupted)."""
    from hooked_models.embedded import task as ioi

    if model.tokenizer is not None and model.cfg.vocab_size == len(ioi.vocabulary()):
        pairs = ioi.make_ioi_prompts(rows // 2, seed, tokenizer=model.tokenizer)
        return torch.cat([pairs.clean_tokens, pairs.corrupted_tokens])
    task = make_task(model, rows // 2, seed)
    return torch.cat([task.clean, task.corrupted])


@contextmanager
def quiet_sae_lens():
    """SAELens's notices about what this script does on purpose, silenced: it passes its own model and
    dataset, trains for several epochs over a small dataset, and SAELens copies tensors it was given.
    And its training bar completed: SAELens advances it every 100 steps, so it would stop short (at 78%
    with the defaults, 128 steps) although the training ran to its last token."""
    from sae_lens.training import sae_trainer

    class CompletingBar(sae_trainer.tqdm):
        def close(self):
            if self.total and self.n < self.total and not self.disable:
                self.update(self.total - self.n)
            super().close()

    sae_logger, level, bar = logging.getLogger("sae_lens"), logging.getLogger("sae_lens").level, sae_trainer.tqdm
    with warnings.catch_warnings():
        for message in ("The training dataset contains fewer samples", "All samples in the training dataset",
                        "To copy construct from a tensor"):
            warnings.filterwarnings("ignore", message=message, module="sae_lens")
        sae_logger.setLevel(logging.ERROR)
        sae_trainer.tqdm = CompletingBar
        try:
            yield
        finally:
            sae_trainer.tqdm = bar
            sae_logger.setLevel(level)


def train(model, tokens: torch.Tensor, args):
    """SAELens's LanguageModelSAETrainingRunner on the model, unchanged (its expected notices silenced)."""
    from datasets import Dataset
    from sae_lens import (LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig,
                          StandardTrainingSAEConfig)

    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:1], names_filter=[args.hook])
    d_in = cache[args.hook][0, 0].numel()  # TransformerLens's layout, heads flattened: what SAELens reads
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=args.d_sae, l1_coefficient=args.l1),
        model_name=type(model).__name__, hook_name=args.hook, dataset_path="", is_dataset_tokenized=True,
        streaming=False, context_size=tokens.shape[1], prepend_bos=False, training_tokens=args.tokens,
        train_batch_size_tokens=256, store_batch_size_prompts=16, n_batches_in_buffer=32, lr=args.lr,
        device=args.device, dtype="float32", seed=args.seed, logger=LoggingConfig(log_to_wandb=False),
        checkpoint_path=None, output_path=None, n_checkpoints=0, verbose=False,
    )
    dataset = Dataset.from_dict({"tokens": tokens.tolist()})
    with quiet_sae_lens():
        return LanguageModelSAETrainingRunner(cfg, override_model=model, override_dataset=dataset).run(), cfg


def evaluate(model, sae, cfg, tokens: torch.Tensor) -> dict:
    """SAELens's evals on held-out prompts: reconstruction, sparsity, next-token loss with the SAE."""
    from datasets import Dataset
    from sae_lens.evals import EvalConfig, run_evals
    from sae_lens.training.activation_scaler import ActivationScaler
    from sae_lens.training.activations_store import ActivationsStore

    batch = 16
    config = EvalConfig(batch_size_prompts=batch, n_eval_reconstruction_batches=tokens.shape[0] // batch,
                        compute_ce_loss=True, compute_kl=True, compute_variance_metrics=True,
                        compute_sparsity_metrics=True, n_eval_sparsity_variance_batches=tokens.shape[0] // batch)
    with quiet_sae_lens():
        store = ActivationsStore.from_config(model, cfg, override_dataset=Dataset.from_dict({"tokens": tokens.tolist()}))
        metrics, _ = run_evals(sae, store, model, ActivationScaler(), config, exclude_special_tokens=False)
    return {k: v for group in metrics.values() for k, v in group.items()}


def context(model, row: torch.Tensor, pos: int, width: int = 4) -> str:
    words = [model.tokenizer.decode([t]) if model.tokenizer is not None else f" {t}" for t in row.tolist()]
    return "".join(words[max(0, pos - width):pos]).strip() + f" [{words[pos].strip()}]"


def main() -> None:
    parser = arguments(__doc__.split("\n")[0], "train_sae")
    parser.add_argument("--hook", default="blocks.1.hook_resid_pre",
                        help="where the SAE reads and writes, either name (default: %(default)s)")
    parser.add_argument("--d-sae", type=int, default=256, help="features (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=32768, help="training tokens (default: %(default)s)")
    parser.add_argument("--l1", type=float, default=0.1, help="the sparsity penalty (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--features", type=int, default=4, help="features to show (default: %(default)s)")
    parser.add_argument("--save", default=None, help="a directory to save the SAE to (SAELens's format)")
    parser.set_defaults(prompts=64)
    args = parser.parse_args()
    args.out = out_path(args)
    try:
        import sae_lens  # noqa: F401
    except ImportError:
        parser.error("SAELens is not installed: install the sae extra in an environment of its own, as this "
                     "script's docstring shows (SAELens needs TransformerLens 3.x)")

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.model == "embedded":
        torch.set_num_threads(1)  # a 64-wide model gains nothing from threads; they only contend
    model = load_model(args)
    tokens = training_tokens(model, 1024, args.seed)
    print(f"{type(model).__name__} ({model.cfg.num_layers} layers); training an SAE of {args.d_sae} features at "
          f"{args.hook} on {args.tokens} tokens ({tokens.shape[0]} prompts of {tokens.shape[1]}) with SAELens")
    sae, cfg = train(model, tokens, args)
    if args.save:
        sae.save_inference_model(args.save)
        print(f"saved the SAE to {args.save}")

    held_out = training_tokens(model, 256, args.seed + 1)
    m = evaluate(model, sae, cfg, held_out)
    print(f"reconstruction (held out): explained variance {m['explained_variance']:.3f}, MSE {m['mse']:.4g}, "
          f"L0 {m['l0']:.1f} of {args.d_sae} features")
    print(f"next-token loss: {m['ce_loss_without_sae']:.4f} without the SAE, {m['ce_loss_with_sae']:.4f} with it, "
          f"{m['ce_loss_with_ablation']:.4f} with the value zeroed (CE-loss score {m['ce_loss_score']:.3f}); "
          f"KL with the SAE {m['kl_div_with_sae']:.4f}")

    # The SAE spliced into the model: the task's behaviour, and each feature's activations.
    task = make_task(model, args.prompts, args.seed + 2)
    with torch.no_grad():
        base = task.metric(model(task.clean))
        logits, cache = model.run_with_cache_with_saes(task.clean, saes=[sae],
                                                       names_filter=lambda n: n.endswith("hook_sae_acts_post"))
    print(f"{task.name}: logit difference {float(base):.3f} without the SAE, "
          f"{float(task.metric(logits)):.3f} with it spliced")
    acts = cache[f"{args.hook}.hook_sae_acts_post"]  # [batch pos d_sae]
    density = (acts > 0).float().mean((0, 1))
    alive = int((density > 0).sum())
    print(f"{alive} of {args.d_sae} features fire on these prompts; the strongest, with the tokens they fire on most:")
    shown = acts.amax((0, 1)).topk(args.features).indices.tolist()
    for f in shown:
        values, where = acts[..., f].flatten().topk(3)
        tops = [context(model, task.clean[i // acts.shape[1]], i % acts.shape[1]) + f" {float(v):.2f}"
                for v, i in zip(values.tolist(), where.tolist())]
        print(f"  feature {f:<4} fires on {float(density[f]):5.1%} of tokens; " + ";  ".join(tops))
    plot(args.out, density, acts[..., shown].mean(0).T, shown, task.position_labels, args.hook)
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


def plot(path: str, density: torch.Tensor, by_position: torch.Tensor, features: list[int], labels: list[str],
         hook: str) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [1, 2]})
    left.hist(torch.log10(density[density > 0]).tolist(), bins=20)
    left.set(xlabel="log10 fraction of tokens a feature fires on", ylabel="features", title="feature density")
    image = right.imshow(by_position.numpy(), aspect="auto", cmap="Blues")
    right.set_xticks(range(len(labels)), labels, rotation=60, fontsize=8)
    right.set_yticks(range(len(features)), [f"feature {f}" for f in features])
    right.set_title(f"mean activation by position ({hook})")
    fig.colorbar(image, ax=right)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
