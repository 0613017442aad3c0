"""Training transcoders from a harvest of every layer's MLP input and output.

`train_transcoders(harvest_dir)` from a `corpus.harvest` of every layer's `mlp_input` and `mlp.mlp_output`
on disk (batches of rows drawn from the memory-mapped dataset, so memory does not grow with the corpus),
or `train_transcoders(model, dataset=...)`, which harvests first. A progress bar; a checkpoint file that a
rerun resumes from (the result is the uninterrupted run's, bit for bit). SAELens (6.x) has transcoder
classes but trains none, so the trainer is this small one.
"""

import json
import math
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from hooked_models.transcoders.activation_functions import check_activation, check_size, step
from hooked_models.transcoders.cross_layer_transcoder import CrossLayerTranscoder
from hooked_models.transcoders.identity import ModelIdentity, input_hook_name, output_hook_name
from hooked_models.transcoders.single_layer_transcoder import Transcoder, TranscoderSet


def init_transcoder_(tc: Transcoder | CrossLayerTranscoder, seed: int = 0, threshold: float = 0.0) -> None:
    """Random weights for training or tests: decoder rows of unit norm, the encoder their transpose
    (as SAELens initializes; scaled normal where d_in != d_out), biases zero, skip zero, JumpReLU
    thresholds `threshold`. A cross-layer decoder is split evenly over the layers it writes."""
    generator = torch.Generator().manual_seed(seed)

    def pair() -> tuple[Tensor, Tensor]:
        w = torch.randn(tc.d_transcoder, tc.d_out, generator=generator)
        w = w / w.norm(dim=-1, keepdim=True)
        if tc.d_in == tc.d_out:
            return w.T, w
        return torch.randn(tc.d_in, tc.d_transcoder, generator=generator) / math.sqrt(tc.d_in), w

    with torch.no_grad():
        if isinstance(tc, Transcoder):
            enc, dec = pair()
            tc.W_enc.copy_(enc)
            tc.W_dec.copy_(dec)
        else:
            for l in range(tc.n_layers):
                enc, dec = pair()
                tc.W_enc[l].copy_(enc)
                tc.W_dec[l].copy_(dec[:, None, :].expand(-1, tc.n_layers - l, -1) / (tc.n_layers - l))
        for name in ("b_enc", "b_dec", "W_skip"):
            if getattr(tc, name, None) is not None:
                getattr(tc, name).zero_()
        if tc.threshold is not None:
            tc.threshold.fill_(threshold)


@dataclass(frozen=True)
class TrainingConfig:
    """What `train_transcoders` trains, and how. The loss per token is, summed over layers, the squared
    error of the MLP output divided by its mean squared norm, plus `sparsity` times the features' L1
    weighted by their decoder norms (ReLU; Anthropic's and SAELens's penalty) or their L0 through the
    straight-through step (JumpReLU; Rajamanoharan et al. 2024); TopK needs none. Adam at `lr`, the
    last fifth of the steps decayed linearly to zero."""

    d_transcoder: int = 256
    activation: str = "relu"
    k: int | None = None
    skip: bool = False
    cross_layer: bool = False
    steps: int = 2000
    batch_tokens: int = 1024
    lr: float = 2e-3
    sparsity: float = 1e-3
    threshold: float = 0.01  # JumpReLU's initial threshold
    bandwidth: float = 0.05  # JumpReLU's straight-through kernel width
    seed: int = 0
    checkpoint_every: int = 250

    def __post_init__(self):
        for name in ("d_transcoder", "steps", "batch_tokens", "checkpoint_every"):
            check_size(name, getattr(self, name))
        check_activation(self.activation, self.k, self.d_transcoder)
        for name in ("lr", "sparsity", "threshold", "bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or (name in ("lr", "bandwidth") and value == 0):
                kind = "positive" if name in ("lr", "bandwidth") else "non-negative"
                raise ValueError(f"{name}={value!r} must be a {kind} number")


_FAMILIES_BY_CLASS = {"HookedArcee": "arcee", "HookedAlphaEr": "alpha_er"}


class HarvestReader:
    """Batches of (MLP inputs, MLP outputs) of every layer from a `corpus.harvest` on disk, drawn at
    random rows of the memory-mapped dataset: one batch in memory, whatever the corpus's size."""

    def __init__(self, path: str | os.PathLike):
        import datasets

        self.path = Path(path)
        manifest_file = self.path / "manifest.json"
        if not manifest_file.is_file():
            raise FileNotFoundError(f"no manifest.json in {self.path}: not a corpus.harvest output")
        manifest = json.loads(manifest_file.read_text())
        if not manifest.get("complete"):
            raise ValueError(f"the harvest in {self.path} is not complete: rerun corpus.harvest to finish it")
        model, config = manifest["model"], manifest["model"]["config"]
        family = _FAMILIES_BY_CLASS.get(model["family"])
        if family is None:
            raise ValueError(f"{self.path} is a harvest of a {model['family']}, not a hooked model family")
        self.identity = ModelIdentity(family, int(config.get("hidden_size", config.get("n_embd"))),
                                      int(config.get("num_layers", config.get("n_layer"))))
        names = [name for l in range(self.identity.num_layers) for name in (input_hook_name(l), output_hook_name(l))]
        missing = [name for name in names if name not in manifest["names"]]
        if missing:
            raise ValueError(f"the harvest in {self.path} lacks {', '.join(missing)}: transcoders of every layer "
                             f"train on {', '.join(names)}")
        self.names, self.context_size = names, int(manifest["context_size"])
        self.dataset = datasets.load_from_disk(str(self.path)).with_format("numpy", columns=names)
        self.rows = len(self.dataset)

    def batch(self, step: int, tokens: int, seed: int) -> tuple[Tensor, Tensor]:
        """Step `step`'s batch, the same on every run: inputs and outputs [layer tokens hidden_size]."""
        rows = max(1, -(-tokens // self.context_size))
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        index = torch.randint(0, self.rows, (rows,), generator=generator).sort().values.tolist()
        data = self.dataset[index]
        def stack(names):  # [layer tokens hidden_size]
            return torch.stack([torch.from_numpy(data[n]).reshape(-1, data[n].shape[-1]) for n in names])

        return stack(self.names[0::2]), stack(self.names[1::2])


def new_transcoders(identity: ModelIdentity, config: TrainingConfig) -> TranscoderSet | CrossLayerTranscoder:
    """Untrained transcoders for a model, as `config` says, initialized from `config.seed`."""
    d = identity.hidden_size
    if config.cross_layer:
        tcs = CrossLayerTranscoder(identity.num_layers, d, config.d_transcoder, activation=config.activation,
                                   k=config.k, skip=config.skip, identity=identity)
        init_transcoder_(tcs, config.seed, config.threshold)
        tcs.bandwidth = config.bandwidth
        return tcs
    layers = []
    for l in range(identity.num_layers):
        tc = Transcoder(d, config.d_transcoder, layer=l, activation=config.activation, k=config.k, skip=config.skip)
        init_transcoder_(tc, config.seed + l, config.threshold)
        tc.bandwidth = config.bandwidth
        layers.append(tc)
    return TranscoderSet(layers, identity=identity)


def _training_loss(tcs, x: Tensor, y: Tensor, scale: Tensor, config: TrainingConfig) -> tuple[Tensor, Tensor]:
    """(loss, normalized squared error per layer) of one batch."""
    pre = [tcs.encode(l, x[l], apply_activation=False) for l in range(tcs.n_layers)]
    acts = [tcs.activate(l, p) for l, p in enumerate(pre)]
    errors = torch.stack([((tcs.decode_to(l, acts, x[l]) - y[l]) ** 2).sum(-1).mean() for l in range(tcs.n_layers)])
    errors = errors / scale
    penalty = torch.zeros(())
    if config.activation == "relu":
        penalty = sum((a * tcs.decoder_norms(l)).sum(-1).mean() for l, a in enumerate(acts))
    elif config.activation == "jumprelu":
        penalty = sum(step(p, tcs.threshold_of(l), config.bandwidth).sum(-1).mean() for l, p in enumerate(pre))
    return errors.sum() + config.sparsity * penalty, errors.detach()


def _lr_factor(step_index: int, steps: int) -> float:
    decay_from = steps - steps // 5
    return 1.0 if step_index < decay_from else (steps - step_index) / (steps - decay_from)


def train_transcoders(source, *, dataset=None, config: TrainingConfig = TrainingConfig(),
                      checkpoint: str | os.PathLike | None = None, progress: bool | None = None,
                      context_size: int | None = None, family: str | None = None,
                      harvest_dir: str | os.PathLike | None = None) -> TranscoderSet | CrossLayerTranscoder:
    """Transcoders (per layer, or one cross-layer transcoder with `config.cross_layer`) trained to map
    every layer's `mlp_input` to its `mlp.mlp_output`.

    source: a `corpus.harvest` directory holding every layer's `layers.{l}.mlp_input` and
      `layers.{l}.mlp.mlp_output`; or, with `dataset`, a model (a hooked model, a checkpoint path or
      "embedded", `family` saying which) whose activations over `dataset` (anything `corpus.harvest`
      takes, with its `context_size`) are harvested first, into `harvest_dir` (default: a temporary one).
    checkpoint: a file written every `config.checkpoint_every` steps and at the end (parameters,
      optimizer state, step); a rerun with the same file, source and config resumes from it and ends
      with the uninterrupted run's weights bit for bit. One of other settings is refused.
    progress: a progress bar (default: on a terminal).
    """
    if dataset is not None:
        if harvest_dir is None:
            with tempfile.TemporaryDirectory(prefix="transcoder-harvest-") as tmp:
                return train_transcoders(source, dataset=dataset, config=config, checkpoint=checkpoint,
                                         progress=progress, context_size=context_size, family=family,
                                         harvest_dir=tmp)
        _harvest_mlps(source, dataset, harvest_dir, context_size, family, progress)
        source = harvest_dir
    elif not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"source is a {type(source).__name__}: pass a harvest directory, or a model with dataset=")
    reader = HarvestReader(source)
    torch.manual_seed(config.seed)
    tcs = new_transcoders(reader.identity, config)
    optimizer = torch.optim.Adam(tcs.parameters(), lr=config.lr)
    x0, y0 = reader.batch(0, config.batch_tokens, config.seed)
    with torch.no_grad():  # the decoder bias starts at the mean output; errors are relative to the output's size
        scale = (y0 ** 2).sum(-1).mean(-1)
        for l in range(tcs.n_layers):
            (tcs[l].b_dec if isinstance(tcs, TranscoderSet) else tcs.b_dec[l]).copy_(y0[l].mean(0))
    start = 0
    job = {"config": asdict(config), "identity": asdict(reader.identity), "rows": reader.rows}
    if checkpoint is not None and Path(checkpoint).is_file():
        saved = torch.load(checkpoint, weights_only=True)
        theirs = json.loads(saved["job"])
        for key, mine in job.items():
            if theirs.get(key) != mine:
                raise ValueError(f"checkpoint {checkpoint} is of another training run: its {key} is {theirs.get(key)}, "
                                 f"this run's {mine}")
        tcs.load_state_dict(saved["transcoders"])
        optimizer.load_state_dict(saved["optimizer"])
        start, scale = int(saved["step"]), saved["scale"]
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=config.steps, initial=start, desc="transcoders", unit="step", disable=not show) as bar:
        for step_index in range(start, config.steps):
            x, y = reader.batch(step_index, config.batch_tokens, config.seed)
            for group in optimizer.param_groups:
                group["lr"] = config.lr * _lr_factor(step_index, config.steps)
            loss, errors = _training_loss(tcs, x, y, scale, config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if config.activation == "jumprelu":
                with torch.no_grad():  # a threshold stays non-negative
                    for l in range(tcs.n_layers):
                        tcs.threshold_of(l).clamp_(min=0)
            done = step_index + 1
            if checkpoint is not None and (done % config.checkpoint_every == 0 or done == config.steps):
                _save_checkpoint(checkpoint, tcs, optimizer, done, scale, job)
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}", fve=f"{1 - errors.mean().item():.3f}", refresh=False)
    return tcs.eval()


def _save_checkpoint(path, tcs, optimizer, step_index: int, scale: Tensor, job: dict) -> None:
    """Written under a temporary name and renamed into place: a killed run leaves the previous one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"transcoders": tcs.state_dict(), "optimizer": optimizer.state_dict(), "step": step_index,
                "scale": scale, "job": json.dumps(job)}, tmp)
    os.replace(tmp, path)


def _harvest_mlps(model, dataset, out, context_size, family, progress) -> None:
    """Every layer's MLP input and output over `dataset`, into `out` (corpus.harvest)."""
    from hooked_models import corpus
    from hooked_models.families import load_model
    from hooked_models.model import HookedModel

    num_layers = (model if isinstance(model, HookedModel) else load_model(model, family)).cfg.num_layers
    names = [name for l in range(num_layers) for name in (input_hook_name(l), output_hook_name(l))]
    corpus.harvest(model, dataset, names, out, context_size=context_size, family=family, progress=progress)

