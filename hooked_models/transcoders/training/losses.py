"""The training objective's pieces: activations chosen across shards, FVU, AuxK, and the sparsity terms.

Each function takes the global batch's statistics it divides by, so that a process's share of a sum over
tokens (data parallel) or features (feature sharded) adds up, over the processes, to the one-process value.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from hooked_models.transcoders.activation_functions import jumprelu, step
from hooked_models.transcoders.training.distributed import Layout


def activate(kind: str, pre: Float[Tensor, "tokens d_transcoder"], layout: Layout, *, k: int | None = None,
             threshold: Tensor | None = None, bandwidth: float = 0.0, batch_tokens: int = 0
             ) -> tuple[Float[Tensor, "tokens d_transcoder"], Tensor | None]:
    """(activations, the smallest kept value for BatchTopK else None) of this process's pre-activations.

    topk: per token, the k largest pre-activations of every shard, through ReLU (the same features an
    unsharded topk keeps: the k-th largest is chosen from each shard's k candidates). batchtopk: the k·B
    largest of the whole batch of B = `batch_tokens` tokens, through ReLU. jumprelu: pre · [pre > θ] with its
    straight-through threshold gradient. relu: relu.
    """
    if kind == "relu":
        return torch.relu(pre), None
    if kind == "jumprelu":
        return jumprelu(pre, threshold, bandwidth), None
    # The k-th largest is taken of relu(pre): what is kept is the same (a kept negative is zero either way), and
    # a row that is mostly zeros is partitioned several times faster (topk of 1,024 x 256 at 2 % positive: 0.8
    # against 2.7 ms), as a trained TopK's rows are.
    if kind == "topk":
        positive = torch.relu(pre)
        values = positive.detach()
        return positive * (values >= layout.kth_largest(values, k)), None
    if kind == "batchtopk":
        kept = k * batch_tokens
        positive = torch.relu(pre)
        kth = layout.kth_largest(positive.detach().flatten(), kept, whole_batch=True)
        return positive * (positive.detach() >= kth), kth.clamp(min=0).reshape(())
    raise ValueError(f"activation {kind!r} is not trained here")


@dataclass
class TopKCode:
    """A token's k kept activations as (values, feature indices): TopK's code without its zeros, so the
    decoder reads k rows per token instead of multiplying d_transcoder zeros (sparsify's sparse decode)."""

    values: Float[Tensor, "tokens k"]
    indices: Int[Tensor, "tokens k"]
    width: int

    def dense(self) -> Float[Tensor, "tokens d_transcoder"]:
        return self.values.new_zeros(self.values.shape[0], self.width).scatter_(-1, self.indices, self.values)


def topk_code(pre: Float[Tensor, "tokens d_transcoder"], k: int) -> TopKCode:
    """TopK through ReLU as a code: the k largest pre-activations of each whole row (unsharded: a sharded
    row's k-th is chosen across processes by `activate`). Its gradient reaches only the kept entries."""
    indices = torch.relu(pre.detach()).topk(k, dim=-1, sorted=False).indices  # (relu: see `activate`)
    return TopKCode(torch.relu(pre.gather(-1, indices)), indices, pre.shape[-1])


def decode(acts: "Tensor | TopKCode", W_dec: Float[Tensor, "d_transcoder d_out"]) -> Float[Tensor, "tokens d_out"]:
    """acts @ W_dec, by an embedding bag (a sum of k decoder rows per token) when acts is a TopK code."""
    if isinstance(acts, TopKCode):
        return F.embedding_bag(acts.indices, W_dec, per_sample_weights=acts.values, mode="sum")
    return acts @ W_dec


def total_variance(y: Float[Tensor, "tokens d_out"], layout: Layout) -> Tensor:
    """Σ|y - ȳ|² over the global batch (float64 sums across processes; ȳ the global mean)."""
    y64 = y.detach().double()
    stats = layout.sum_tokens(torch.cat([y64.sum(0), (y64 ** 2).sum().reshape(1),
                                         torch.tensor([float(y.shape[0])], dtype=torch.float64, device=y.device)]))
    total, squares, n = stats[:-2], stats[-2], stats[-1]
    return (squares - (total ** 2).sum() / n).to(y.dtype)


def fvu(error: Float[Tensor, "tokens d_out"], variance: Tensor) -> Tensor:
    """This process's share of the fraction of variance unexplained, Σ|e|² / Σ|y - ȳ|² (sparsify's FVU)."""
    return (error ** 2).sum() / variance


def auxk_k(d_out: int, dead: int) -> tuple[int, float]:
    """(how many dead features AuxK uses, its loss's scale): d_out // 2 (Gao et al. 2024, appendix B.1)
    at most the number dead, the loss scaled by min(dead / (d_out // 2), 1), as sparsify does."""
    k_aux = max(d_out // 2, 1)
    return min(k_aux, dead), min(dead / k_aux, 1.0)


def auxk_acts(pre: Float[Tensor, "tokens d_transcoder"], dead: Tensor, k_aux: int, count: int, layout: Layout
              ) -> tuple[Float[Tensor, "tokens dead"], Int[Tensor, " dead"]]:
    """(activations, features): this process's dead features (`count` of them across shards) as columns,
    each token's k_aux largest dead pre-activations (across shards) through ReLU, the others zero. Only the
    dead columns are formed (a few of the width, as a rule); where k_aux takes every dead feature (count <=
    k_aux, the same on every process) no k-th largest is needed."""
    features = dead.nonzero().flatten()
    acts = torch.relu(pre[:, features])
    if count > k_aux:
        acts = acts * (acts.detach() >= layout.kth_largest(acts.detach(), k_aux))
    return acts, features


def l1_penalty(acts: Tensor, decoder_norms: Tensor, tokens: int) -> Tensor:
    """Σ_i f_i ‖W_dec,i‖, per token of the global batch (ReLU transcoders; Anthropic's, SAELens's)."""
    return (acts * decoder_norms).sum() / tokens


def tanh_penalty(acts: Tensor, decoder_norms: Tensor, scale: float, tokens: int) -> Tensor:
    """Σ_i tanh(c · |f_i| · ‖W_dec,i‖), per token: Anthropic's JumpReLU sparsity penalty ("Circuit tracing",
    2025), a smooth L0 that stops pushing on features already large."""
    return torch.tanh(scale * acts.abs() * decoder_norms).sum() / tokens


def l0_penalty(pre: Tensor, threshold: Tensor, bandwidth: float, tokens: int) -> Tensor:
    """Σ_i [pre_i > θ_i], per token, through the straight-through step (Rajamanoharan et al. 2024)."""
    return step(pre, threshold, bandwidth).sum() / tokens


def pre_act_loss(pre: Tensor, threshold: Tensor, decoder_norms: Tensor, tokens: int) -> Tensor:
    """Σ_i relu(θ_i - pre_i) ‖W_dec,i‖, per token: Anthropic's pre-activation loss, a gradient that lifts
    features below their thresholds (dead ones included) towards firing."""
    return (torch.relu(threshold - pre) * decoder_norms).sum() / tokens
