"""`train_transcoders`: the training loop, the same in one process and in many.

Each step: this process's share of the batch from the source (the feature-sharded layout gathers the whole
batch), the loss (training/objective.py), backward, gradients summed over processes (data parallel), Adam,
then thresholds and dead-feature counters. Checkpoints per shard; curves every `log_every` steps.
"""

import os
import time
from dataclasses import asdict

import torch

from hooked_models.progress import Cancelled, ProgressArg, tracker
from hooked_models.transcoders.evaluation import evaluate
from hooked_models.transcoders.identity import ModelIdentity
from hooked_models.transcoders.training import checkpoints
from hooked_models.transcoders.training.config import TrainingConfig
from hooked_models.transcoders.training.distributed import Layout, default_device, process_group
from hooked_models.transcoders.training.objective import after_step, batch_loss
from hooked_models.transcoders.training.report import write_report
from hooked_models.transcoders.training.sources import HarvestReader, HarvestSource, StreamingSource
from hooked_models.transcoders.training.state import Shard


def lr_factor(step: int, config: TrainingConfig) -> float:
    """Linear warm-up over `config.warmup` steps, constant, then linear decay to zero over the last `decay_fraction`."""
    factor = min(1.0, (step + 1) / config.warmup) if config.warmup else 1.0
    decay_from = config.steps - int(config.steps * config.decay_fraction)
    if step >= decay_from:
        factor *= (config.steps - step) / (config.steps - decay_from)
    return factor


def train_transcoders(source, *, dataset=None, config: TrainingConfig = TrainingConfig(),
                      checkpoint: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
                      progress: ProgressArg = None, context_size: int | None = None, column: str | None = None,
                      family: str | None = None, harvest_dir: str | os.PathLike | None = None, eval_dataset=None,
                      dtype=None, device=None):
    """Transcoders trained to map each layer's `mlp_input` to its `mlp.mlp_output`: per layer (a
    `TranscoderSet`; `{layer: Transcoder}` with `config.layers`) or one `CrossLayerTranscoder`.

    source: a model (a hooked model, a checkpoint path or "embedded", `family` saying which, loaded in
      `dtype`) with `dataset` (token windows [n seq] or a .pt/.npy/.safetensors file of them, a `datasets`
      dataset or its path; text is packed into `context_size` windows),
      streamed: the frozen model runs over the dataset as training consumes it (epoch after epoch), through a
      shuffling buffer of `config.buffer_tokens`. With `harvest_dir`, the activations are harvested there
      first (`corpus.harvest`) and read back. Or a `corpus.harvest` directory of every layer's MLP input and
      output.
    checkpoint: a directory; every `config.checkpoint_every` steps, at the end and on cancelling, each
      process writes its shard there. A rerun with the same directory resumes from the last complete
      checkpoint (after a crash or a killed process too) and ends with the uninterrupted run's weights.
    out: a directory for the result (circuit-tracer's layout, loaded by `load_transcoders` and
      circuit-tracer), its `training.json` report (config, curves of FVU, L0 and dead % against tokens, time)
      and `training.png` (the curves).
    progress: a bar (default: on a terminal) or a callable; one raising `Cancelled` stops every process at
      the same step, after a checkpoint where there is one.
    eval_dataset: with a model and `out`, held-out token windows the result is measured on at the end
      (`transcoders.evaluate`: FVU, L0, dead %, loss recovered, the replacement model's ΔCE and KL), written
      into training.json as "evaluation" (a result of some layers only is not evaluated).

    device: where the transcoders train (and a model loaded from a path runs): default, a given model's
      device, else this process's GPU under torchrun where there are GPUs (nccl between them), else the CPU
      (gloo). The streaming buffer stays in host memory; each batch moves to the device.

    Runs in the default process group: the one set up already (Ray Train, torchrun's environment) or a group
    of one. Training works where the caller turned gradients off, and leaves that setting as it was.
    """
    from hooked_models.model import HookedModel

    if device is None:
        device = next(source.parameters()).device if isinstance(source, HookedModel) else default_device()
    device = torch.device(device)
    with process_group(device), torch.enable_grad():
        layout = Layout(config.layout, config.d_transcoder, device)
        identity, stream, job = _source(source, dataset, config, layout, context_size, column, family, harvest_dir,
                                        dtype)
        if eval_dataset is not None and (out is None or not isinstance(stream, StreamingSource)):
            raise ValueError("eval_dataset= needs a model (with dataset=) and out= for the report it is written to")
        shard = Shard(identity, config, layout)
        evaluation = None if eval_dataset is None else (stream.model, eval_dataset)
        return _train(shard, stream, job, config, layout, checkpoint, out, progress, evaluation)


def _source(source, dataset, config, layout, context_size, column, family, harvest_dir, dtype=None):
    """(the model identity, the batch source for this process, what identifies the run in a checkpoint)."""
    share = (layout.rank, layout.world)  # feature-sharded processes gather the shares into the whole batch
    job = {"config": {k: v for k, v in asdict(config).items() if k not in ("checkpoint_every", "log_every")},
           "layout": layout.kind}
    if dataset is not None:
        from hooked_models.families import load_model
        from hooked_models.model import HookedModel

        if isinstance(source, HookedModel) and dtype is not None:
            raise ValueError(f"dtype={dtype} is for a model loaded from a path; this one is loaded (in "
                             f"{next(source.parameters()).dtype})")
        model = source if isinstance(source, HookedModel) else load_model(source, family, dtype, layout.device)
        identity = ModelIdentity.of(model)
        layers = _layers(identity, config)
        if harvest_dir is not None:
            _harvest_mlps(model, dataset, harvest_dir, context_size, layout)
            return _source(harvest_dir, None, config, layout, None, None, None, None)
        streams = config.streams or layout.world
        stream = StreamingSource(model, dataset, layers, batch_tokens=config.batch_tokens,
                                 buffer_tokens=config.buffer_tokens, forward_batch=config.forward_batch,
                                 streams=streams, share=share, seed=config.seed, context_size=context_size,
                                 column=column)
        return identity, stream, {**job, "identity": asdict(identity), "streams": streams,
                                  "context_size": stream.context_size,
                                  "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"source is a {type(source).__name__}: pass a harvest directory, or a model with dataset=")
    reader = HarvestReader(source)
    layers = _layers(reader.identity, config)
    stream = HarvestSource(reader, layers, config.batch_tokens, config.seed, share)
    return reader.identity, stream, {**job, "identity": asdict(reader.identity), "rows": reader.rows}


def _layers(identity: ModelIdentity, config: TrainingConfig) -> list[int]:
    layers = list(config.layers or range(identity.num_layers))
    if layers[-1] >= identity.num_layers:
        raise ValueError(f"layers={config.layers!r}: the model has layers 0 ... {identity.num_layers - 1}")
    return layers


def _harvest_mlps(model, dataset, out, context_size, layout: Layout) -> None:
    """Every layer's MLP input and output over `dataset`, into `out` (corpus.harvest), by process 0."""
    from hooked_models import corpus
    from hooked_models.transcoders.identity import input_hook_name, output_hook_name

    if layout.rank == 0:
        names = [n for l in range(model.cfg.num_layers) for n in (input_hook_name(l), output_hook_name(l))]
        corpus.harvest(model, dataset, names, out, context_size=context_size, progress=False)
    layout.barrier()


def _train(shard: Shard, stream, job: dict, config: TrainingConfig, layout: Layout, checkpoint, out, progress,
           evaluation):
    params = shard.trained_parameters()
    optimizer = torch.optim.Adam(params, lr=config.lr)
    start, curves, seconds = 0, [], 0.0
    if checkpoint is not None:
        resumed = checkpoints.load(checkpoint, job, layout)
        if resumed is not None:
            start, state = resumed
            shard.load_state_dict(state["shard"])
            optimizer.load_state_dict(state["optimizer"])
            stream.load_state(state["source"])
            curves, seconds = state["curves"], state["cpu_seconds"]

    def save(step):
        state = {"shard": shard.state_dict(), "optimizer": optimizer.state_dict(), "source": stream.state(),
                 "curves": curves, "cpu_seconds": seconds + time.process_time() - began}
        checkpoints.save(checkpoint, step, state, job, layout)

    tokens = config.batch_tokens
    began = time.process_time()
    bar = tracker(progress if layout.rank == 0 or callable(progress) else False, total=config.steps,
                  desc="transcoders", unit="step")
    bar.done = start
    if bar.bar is not None:
        bar.bar.update(start)
    with bar:
        for step in range(start, config.steps):
            x, y = stream.batch()
            x, y = layout.gather_tokens(x.to(layout.device)), layout.gather_tokens(y.to(layout.device))
            if step == 0:
                first_batch_init(shard, x, y, layout, tokens)
            for group in optimizer.param_groups:
                group["lr"] = config.lr * lr_factor(step, config)
            result = batch_loss(shard, x, y, config, layout, tokens)
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            layout.reduce_gradients(params)
            optimizer.step()
            after_step(shard, result, config, layout, tokens, step)
            done = step + 1
            if done % config.log_every == 0 or done == config.steps:
                curves.append(_measure(shard, result, config, layout, done * tokens))
            if checkpoint is not None and (done % config.checkpoint_every == 0 or done == config.steps):
                save(done)
            if _cancelled(bar, layout):
                if checkpoint is not None and done % config.checkpoint_every and done != config.steps:
                    save(done)
                raise Cancelled(f"training stopped after step {done} of {config.steps}")
    result = shard.gathered()
    seconds += time.process_time() - began
    if out is not None and layout.rank == 0:
        run = {"processes": layout.world, "layout": layout.kind, "cpu_seconds": seconds,
               "tokens": config.steps * tokens, "layers": shard.layers, "identity": job["identity"]}
        measured = None
        if evaluation is not None and not isinstance(result, dict):
            model = evaluation[0]
            measured = evaluate(model, result.to(next(model.parameters()).device), evaluation[1], progress=False)
            result = result.cpu()
        write_report(out, result, config, curves, run, measured)
    if out is not None:
        layout.barrier()
    return result


def _cancelled(bar, layout: Layout) -> bool:
    """Whether any process's progress callable asked to stop at this step (all then stop together)."""
    try:
        bar.advance()
        stop = torch.zeros((), dtype=torch.int32, device=layout.device)
    except Cancelled:
        stop = torch.ones((), dtype=torch.int32, device=layout.device)
    return bool(layout.sum_all(stop))


@torch.no_grad()
def first_batch_init(shard: Shard, x, y, layout: Layout, tokens: int) -> None:
    """What the first batch sets (`tokens` of them, across the processes): with init_spread="equal", each
    encoder column scaled so that its centred pre-activations' standard deviation is the mean over every
    feature (of every shard); then the decoder bias at the batch's mean output and the encoder bias centring
    its pre-activations (b_enc = -mean(x) @ W_enc: sparsify's, equivalent to Anthropic's subtracting the
    decoder bias). Sums in float64."""
    for i, l in enumerate(shard.layers):
        x64 = x[i].double()
        mean_x = layout.sum_tokens(x64.sum(0)) / tokens
        mean_y = layout.sum_tokens(y[i].double().sum(0)) / tokens
        if shard.config.init_spread == "equal":
            enc = shard.enc(l)
            spread = layout.sum_tokens(((x64 - mean_x) @ enc.double()).pow(2).sum(0)).div(tokens).sqrt()
            mean = layout.sum_features(spread.sum()) / shard.config.d_transcoder
            enc.mul_((mean / spread.clamp(min=1e-30)).to(enc.dtype))
        shard.b_dec(l).copy_(mean_y)
        shard.b_enc(l).copy_(-(mean_x.to(x.dtype) @ shard.enc(l)))


@torch.no_grad()
def _measure(shard: Shard, result, config: TrainingConfig, layout: Layout, tokens_seen: int) -> dict:
    """One point of the curves: the batch's FVU, L0 and dead % per layer, AuxK, and tokens seen."""
    fvu = [float(layout.sum_tokens(f)) for f in result.fvu]
    l0 = [float(layout.sum_all((result.acts[l] > 0).sum().double())) / config.batch_tokens for l in shard.layers]
    dead = [100.0 * float(layout.sum_features((shard.since_fired[l] >= config.dead_tokens).sum()))
            / config.d_transcoder for l in shard.layers]
    return {"tokens": tokens_seen, "fvu": fvu, "l0": l0, "dead_pct": dead,
            "auxk": float(layout.sum_tokens(result.auxk))}
