"""What a row of the graph is computed for: a target's input direction, given to the backward pass as
the gradient where the target reads (a transcoder's input at one position, or the logits)."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.attribution.replacement import Replica


@dataclass
class Target:
    """A node whose row is computed: where it reads (a transcoder layer, or None: the logits), at
    which position, along which direction."""

    layer: int | None
    pos: int
    direction: Tensor


def directions(replica: Replica, targets: Sequence[Target]) -> tuple[dict, Tensor | None]:
    """The targets' input directions as gradients: [batch seq d_in] at each transcoder input read,
    [batch seq vocab] at the logits (target b in copy b of the prompt)."""
    tcs = replica.prompt.transcoders
    batch, seq = replica.logits.shape[:2]
    device = replica.logits.device
    grad_inputs, grad_logits = {}, None
    for b, target in enumerate(targets):
        if target.layer is None:
            if grad_logits is None:
                grad_logits = torch.zeros(replica.logits.shape, dtype=target.direction.dtype, device=device)
            grad_logits[b, target.pos] = target.direction.to(device)
        else:
            if target.layer not in grad_inputs:
                grad_inputs[target.layer] = torch.zeros(batch, seq, tcs.d_in, dtype=target.direction.dtype, device=device)
            grad_inputs[target.layer][b, target.pos] = target.direction.to(device)
    return grad_inputs, grad_logits


def target_rows(replica: Replica, targets: Sequence[Target]) -> Float[Tensor, "target source"]:
    return replica.columns(*directions(replica, targets))[:len(targets)]


