"""One batch's loss: the transcoders' reconstruction of every trained layer, AuxK and the sparsity terms."""

from dataclasses import dataclass

import torch
from torch import Tensor

from hooked_models.transcoders.training.config import TrainingConfig
from hooked_models.transcoders.training.distributed import Layout
from hooked_models.transcoders.training.losses import (
    TopKCode,
    activate,
    auxk_acts,
    auxk_k,
    decode,
    fvu,
    l0_penalty,
    l1_penalty,
    pre_act_loss,
    tanh_penalty,
    topk_code,
    total_variance,
)
from hooked_models.transcoders.training.state import Shard


# TopK rows are decoded as k decoder rows each (an embedding bag) where the width is at least this many times k;
# below it a dense matmul over the zeros is faster on a CPU (one thread, forward and backward: width 256 at k 16
# 3 ms dense, 3.5 ms sparse; 1,024 at 16 14 ms, 6 ms; 8,192 at 64 with d 512, 216 ms, 41 ms).
SPARSE_DECODE_RATIO = 32


@dataclass
class BatchResult:
    """This process's share of the loss (its backward gives its parameters' share of the gradient), and
    what the trainer needs after the step."""

    loss: Tensor
    fvu: list[Tensor]  # per trained layer, this process's share (data parallel) or the whole (sharded)
    auxk: Tensor
    acts: dict[int, Tensor]  # per layer, this process's features' activations
    kept: dict[int, Tensor | None]  # BatchTopK: the smallest activation kept


def batch_loss(shard: Shard, x: Tensor, y: Tensor, config: TrainingConfig, layout: Layout, tokens: int
               ) -> BatchResult:
    """The loss of one batch: x, y [layer tokens d] (the trained layers, in `shard.layers` order), `tokens`
    the global batch's size."""
    pre, acts, kept = {}, {}, {}
    for i, l in enumerate(shard.layers):
        pre[l] = x[i] @ shard.enc(l) + shard.b_enc(l)
        sparse = config.activation == "topk" and config.d_transcoder >= SPARSE_DECODE_RATIO * config.k
        if sparse and not layout.sharded:  # a whole row, few of it kept: decoded sparsely
            acts[l], kept[l] = topk_code(pre[l], config.k), None
        else:
            acts[l], kept[l] = activate(config.activation, pre[l], layout, k=config.k,
                                        threshold=shard.threshold(l), bandwidth=config.bandwidth,
                                        batch_tokens=tokens)
    aux = _auxk_activations(shard, pre, config, layout)
    loss, aux_loss, fvus = x.new_zeros(()), x.new_zeros(()), []
    for i, t in enumerate(shard.layers):
        partial = sum(decode(acts[s], shard.dec(s, t)) for s in shard.sources(t))
        y_hat = layout.sum_partials(partial) + shard.b_dec(t)
        if shard.skip(t) is not None:
            y_hat = y_hat + x[i] @ shard.skip(t).T
        error = y[i] - y_hat
        variance = total_variance(y[i], layout)
        part = fvu(error, variance)
        loss, fvus = loss + part, [*fvus, part.detach()]
        sources = [s for s in shard.sources(t) if s in aux]
        if sources:  # dead features reconstruct what the live ones leave (no bias: e already holds it)
            e_hat = layout.sum_partials(sum(aux[s][0] @ shard.dec(s, t)[aux[s][1]] for s in sources))
            scale = sum(aux[s][2] for s in sources) / len(shard.sources(t))
            aux_loss = aux_loss + scale * fvu(e_hat - error.detach(), variance)
    loss = loss + config.auxk_alpha * aux_loss
    for l in shard.layers:
        norms = shard.decoder_norms(l)
        if config.activation == "relu":
            loss = loss + config.sparsity * l1_penalty(acts[l], norms, tokens)
        elif config.activation == "jumprelu":
            if config.penalty == "tanh":
                loss = loss + config.sparsity * tanh_penalty(acts[l], norms, config.tanh_scale, tokens)
            else:
                loss = loss + config.sparsity * l0_penalty(pre[l], shard.threshold(l), config.bandwidth, tokens)
            if config.pre_act_loss:
                loss = loss + config.pre_act_loss * pre_act_loss(pre[l], shard.threshold(l), norms, tokens)
    dense = {l: TopKCode(a.values.detach(), a.indices, a.width).dense() if isinstance(a, TopKCode) else a.detach()
             for l, a in acts.items()}
    return BatchResult(loss, fvus, aux_loss.detach(), dense, kept)


def _auxk_activations(shard: Shard, pre: dict, config: TrainingConfig, layout: Layout) -> dict:
    """{layer: (the AuxK activations of its dead features [tokens dead], those features, the loss scale)} for
    layers with dead features."""
    if not config.auxk_alpha or config.activation not in ("topk", "batchtopk"):
        return {}
    out = {}
    for l in shard.layers:
        dead = shard.since_fired[l] >= config.dead_tokens
        count = int(layout.sum_features(dead.sum()))
        if count:
            k_aux, scale = auxk_k(shard.identity.hidden_size, count)
            out[l] = (*auxk_acts(pre[l], dead, k_aux, count, layout), scale)
    return out


@torch.no_grad()
def after_step(shard: Shard, result: BatchResult, config: TrainingConfig, layout: Layout, tokens: int,
               step: int) -> None:
    """What the optimizer does not do: thresholds kept non-negative (JumpReLU), BatchTopK's running threshold
    (the smallest kept activation's mean over the steps, recent ones weighted as `threshold_momentum`
    says), and each feature's count of
    tokens since it last fired."""
    for l in shard.layers:
        threshold = shard.threshold(l)
        if config.activation == "jumprelu":
            threshold.clamp_(min=0)
        elif config.activation == "batchtopk" and result.kept[l] is not None:
            # The mean over the steps so far, then (past 1/momentum steps) a running mean of the recent ones.
            weight = max(config.threshold_momentum, 1 / (step + 1))
            threshold.add_(weight * (result.kept[l] - threshold))
        fired = layout.any_tokens((result.acts[l] > 0).any(0))
        shard.since_fired[l] += tokens
        shard.since_fired[l][fired] = 0
