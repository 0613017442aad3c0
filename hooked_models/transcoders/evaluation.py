"""`evaluate`: how well transcoders replace a model's MLPs, measured over a dataset batch by batch.

    report = evaluate(model, transcoders, dataset, batch_size=32)   # token windows [n seq], or a datasets one
    report["fvu"][l], report["loss_recovered"], report["kl_divergence"]

Every number is a sum over the whole dataset, accumulated in float64 one batch at a time (memory holds one
batch, never the dataset), divided at the end: streaming in batches of any size gives the numbers of one
pass over everything. `transcoder_fidelity` is the same measure on one batch of tokens, without the
per-layer splices, L0 and dead features.
"""

import math

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from hooked_models.corpus.data import read_corpus, window_batches
from hooked_models.progress import ProgressArg, tracker
from hooked_models.transcoders.cross_layer_transcoder import CrossLayerTranscoder
from hooked_models.transcoders.single_layer_transcoder import TranscoderSet


class _LayerSums:
    """One layer's running sums: the reconstruction's squared error, the MLP output's sum and squared
    norm (about a fixed shift: the first batch's mean, so that a large mean cannot cancel the variance
    out of float64), active features, which features fired, and the losses with this layer spliced in
    and with its MLP zero-ablated."""

    def __init__(self, d_transcoder: int):
        self.error = self.squares = self.active = self.spliced = self.zero = 0.0
        self.shift = self.sum = None
        self.fired = torch.zeros(d_transcoder, dtype=torch.bool)

    def add(self, y: Float[Tensor, "batch seq d_out"], y_hat: Float[Tensor, "batch seq d_out"],
            acts: Float[Tensor, "batch seq d_transcoder"]) -> None:
        y = y.flatten(0, -2).double()
        self.error += float((y - y_hat.flatten(0, -2).double()).pow(2).sum())
        if self.shift is None:
            self.shift, self.sum = y.mean(0), torch.zeros_like(y[0])
        centred = y - self.shift
        self.sum += centred.sum(0)
        self.squares += float(centred.pow(2).sum())
        on = acts.flatten(0, -2) != 0
        self.active += float(on.sum())
        self.fired |= on.any(0).cpu()

    def fvu(self, tokens: int) -> float:
        """Σ|y - ŷ|² / Σ|y - ȳ|², ȳ the mean over every token (Σ|y - c|² - |Σ(y - c)|²/N, any shift c)."""
        return self.error / (self.squares - float(self.sum.pow(2).sum()) / tokens)


def _cross_entropy(model, logits: Float[Tensor, "batch seq vocab"], tokens: Int[Tensor, "batch seq"]) -> float:
    """The summed next-token loss of the batch (the model's own per-token loss, summed in float64)."""
    return float(model.loss(logits, tokens, per_token=True).double().sum())


def _kl(p_logits: Float[Tensor, "batch seq vocab"], q_logits: Float[Tensor, "batch seq vocab"]) -> float:
    """Σ over positions of KL(p ‖ q) = Σ_v p log(p / q), each position's next-token distributions."""
    log_p, log_q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).double().sum())


def _zero(y: Tensor, hook) -> Tensor:
    return torch.zeros_like(y)


def _windows(model, dataset, context_size: int | None, column: str | None, batch_size: int):
    """(a function giving batches of `batch_size` token windows, the number of windows, the context size):
    the corpus reader's windows, counted first in one streaming pass (text is tokenized for it), so that
    the progress total is known and an empty dataset or a bad token id is refused before any forward."""
    corpus = read_corpus(dataset, column)
    chunks, context_size = window_batches(corpus, model, context_size)
    if context_size < 2:
        raise ValueError(f"context_size={context_size}: a window needs 2 tokens or more to predict a next token")
    rows = 0
    for chunk in chunks:
        if len(chunk) and (chunk.min() < 0 or chunk.max() >= model.cfg.vocab_size):
            raise ValueError(f"a token id of the dataset is outside the model's vocabulary [0, {model.cfg.vocab_size})")
        rows += len(chunk)
    if rows == 0:
        raise ValueError("the dataset is empty: it gives no token window (text shorter than one context_size?)")

    def batches():
        held = np.zeros((0, context_size), dtype=np.int64)  # the corpus's chunks, cut into batches
        for chunk in window_batches(corpus, model, context_size)[0]:
            held = np.concatenate([held, chunk])
            while len(held) >= batch_size:
                yield held[:batch_size]
                held = held[batch_size:]
        if len(held):
            yield held

    return batches, rows, context_size


@torch.no_grad()
def evaluate(model, transcoders, dataset, *, batch_size: int = 32, context_size: int | None = None,
             column: str | None = None, progress: ProgressArg = None) -> dict:
    """How well `transcoders` replace the model's MLPs over `dataset`, as a JSON-serialisable dict.

    dataset: token windows (a LongTensor or integer array [n seq]), or what `corpus.harvest` reads (a
      `datasets` Dataset or the path of one saved to disk, its token `column` or text packed into windows
      of `context_size`). Each window is one row of a batch; there is no padding. The windows are counted
      first in a streaming pass (the progress total; text is tokenized for it and again for the run).
    transcoders: a `TranscoderSet`, `LazyTranscoderSet` (each layer's file is read twice a batch) or
      `CrossLayerTranscoder`, for this model (`check_model`).
    progress: tokens done (`progress.py`); a callable raising `Cancelled` stops it at a batch boundary,
      every hook removed.

    Per layer l (lists indexed by layer), from the model's own run:
    fvu: fraction of variance unexplained, as EleutherAI's sparsify defines it: Σ|y - ŷ|² / Σ|y - ȳ|² over
      every token, y the MLP output (`layers.{l}.mlp.mlp_output`), ȳ its mean over every token, ŷ the
      transcoders' output from the model's own MLP inputs (`layers.{l}.mlp_input`), skip connection included.
      A cross-layer transcoder's is the target layer's: layer l's output from the features of layers 0 ... l.
    variance_explained: 1 - fvu.
    l0: the mean number of layer l's features active (non-zero) per token.
    dead_percent: the percentage of layer l's features active on no token at all.
    layer_loss_spliced, layer_loss_zero_ablated: the next-token loss with only layer l's MLP output replaced
      by ŷ, and with only it zeroed; layer_loss_recovered: (zero_ablated - spliced) / (zero_ablated - loss).

    The replacement model (every layer's MLP output replaced at once, each layer's features encoded from
    the replacement model's own MLP input, no error terms: `transcoder_fidelity`'s `loss_spliced`):
    loss, loss_spliced, loss_zero_ablated: the mean next-token cross-entropy (over every position but each
      window's last) of the model, of the replacement, and with every MLP output zero;
    loss_gap: loss_spliced - loss (ΔCE); loss_recovered: (zero_ablated - spliced) / (zero_ablated - loss),
      1 for a perfect replacement, 0 for one no better than no MLPs;
    kl_divergence: KL(model ‖ replacement) of the next-token distributions, Σ_v p log(p/q), averaged over
      every position (each window's last included).

    tokens (windows x context_size), windows, context_size, batches: what was evaluated.
    """
    if not isinstance(transcoders, (TranscoderSet, CrossLayerTranscoder)):
        raise ValueError(f"transcoders is a {type(transcoders).__name__}; evaluate takes a TranscoderSet, "
                         "LazyTranscoderSet or CrossLayerTranscoder")
    transcoders.check_model(model)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    batches, windows, context_size = _windows(model, dataset, context_size, column, batch_size)
    n = transcoders.n_layers
    layers = [_LayerSums(transcoders.d_transcoder) for _ in range(n)]
    whole = dict(loss=0.0, spliced=0.0, zero=0.0, kl=0.0)
    device = next(model.parameters()).device
    done = 0
    with tracker(progress, total=windows * context_size, desc="evaluate transcoders", unit="tok") as steps:
        for batch in batches():
            tokens = torch.from_numpy(batch).long().to(device)
            _add_batch(model, transcoders, tokens, layers, whole)
            done += 1
            steps.advance(tokens.numel())
    tokens, predicted = windows * context_size, windows * (context_size - 1)
    loss, spliced, zero = (whole[key] / predicted for key in ("loss", "spliced", "zero"))
    per_layer = {"fvu": [s.fvu(tokens) for s in layers]}
    per_layer["variance_explained"] = [1 - fvu for fvu in per_layer["fvu"]]
    per_layer["l0"] = [s.active / tokens for s in layers]
    per_layer["dead_percent"] = [100 * float((~s.fired).sum()) / len(s.fired) for s in layers]
    per_layer["layer_loss_spliced"] = [s.spliced / predicted for s in layers]
    per_layer["layer_loss_zero_ablated"] = [s.zero / predicted for s in layers]
    per_layer["layer_loss_recovered"] = [_recovered(z, s, loss) for z, s in
                                         zip(per_layer["layer_loss_zero_ablated"], per_layer["layer_loss_spliced"])]
    return {**per_layer, "loss": loss, "loss_spliced": spliced, "loss_zero_ablated": zero,
            "loss_gap": spliced - loss, "loss_recovered": _recovered(zero, spliced, loss),
            "kl_divergence": whole["kl"] / tokens, "tokens": tokens, "windows": windows,
            "context_size": context_size, "batches": done}


def _recovered(zero: float, spliced: float, loss: float) -> float:
    return (zero - spliced) / (zero - loss) if zero != loss else math.nan


def _add_batch(model, transcoders, tokens: Int[Tensor, "batch seq"], layers: list[_LayerSums], whole: dict) -> None:
    """One batch's sums: the model's run (cached), each layer's reconstruction and single splices, the
    replacement model's run and the all-zero one."""
    n = transcoders.n_layers
    inputs, outputs = [transcoders.input_hook(l) for l in range(n)], [transcoders.output_hook(l) for l in range(n)]
    streams = [f"layers.{l}.layer_input" for l in range(n)]
    wanted = {*inputs, *outputs, *streams}
    logits, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted, return_cache_object=False)
    whole["loss"] += _cross_entropy(model, logits, tokens)
    acts = []
    for l in range(n):  # layer by layer, so that a lazily loaded set reads each layer once here
        x, y = cache[inputs[l]], cache[outputs[l]]
        acts.append(transcoders.encode(l, x))
        y_hat = transcoders.decode_to(l, acts, x)
        layers[l].add(y, y_hat, acts[l])
        # Only layer l replaced: the layers below run as the model's, so the run starts at layer l from the
        # cached stream (exact: the model's partial runs give the full run's logits bit for bit).
        def only(write, l=l):
            run = model.run_with_hooks(cache[streams[l]], start_at_layer=l, tokens=tokens,
                                       fwd_hooks=[(outputs[l], write)])
            return _cross_entropy(model, run, tokens)

        layers[l].spliced += only(lambda t, hook: y_hat.to(t.dtype))
        layers[l].zero += only(_zero)
    replaced = model.run_with_hooks(tokens, fwd_hooks=transcoders.replacement_hooks())
    whole["spliced"] += _cross_entropy(model, replaced, tokens)
    whole["kl"] += _kl(logits, replaced)
    zeroed = model.run_with_hooks(tokens, fwd_hooks=[(name, _zero) for name in outputs])
    whole["zero"] += _cross_entropy(model, zeroed, tokens)
