"""What a row of the graph is computed for: a target's input direction, given to the backward pass as
the gradient where the target reads (a transcoder's input at one position, or the logits); and the
graph's output nodes, as circuit-tracer's `AttributionTargets` / `CustomTarget` name them.

    attribute(model, prompt, tcs)                                   # the salient logits (the default)
    attribute(model, prompt, tcs, targets=[" Mary", 523])           # token strings or ids
    attribute(model, prompt, tcs, targets=[(" Mary", " John")])     # a logit difference
    attribute(model, prompt, tcs, targets=[CustomTarget("mary-ness", direction, pos=5)])

An output node's value is its direction dotted with the logits at its position: a token's logit minus
the mean logit (circuit-tracer's), a difference of two logits, or any direction over the vocabulary.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from hooked_models.attribution.replacement import Replica


@dataclass(frozen=True)
class CustomTarget:
    """A named direction over the vocabulary at a position (-1: the last): the node's value is
    `direction @ logits[pos]`; `weight` is its weight as an output (a token's is its probability)."""

    name: str
    direction: Float[Tensor, " vocab"]
    pos: int = -1
    weight: float = 1.0


@dataclass(frozen=True)
class OutputTarget:
    """An output node, resolved: its name, its token (-1: not one token), position, direction, weight."""

    name: str
    token: int
    pos: int
    direction: Float[Tensor, " vocab"]
    weight: float


def resolve(model, spec, logits: Float[Tensor, "seq vocab"]) -> list[OutputTarget]:
    """The output nodes that `attribute(targets=spec)` names: token ids and one-token strings (at the last
    position, weighted by their probability), (a, b) logit differences (weight 1), `CustomTarget`s."""
    seq, vocab = logits.shape
    probs = torch.softmax(logits[-1].float(), -1)
    items = spec if isinstance(spec, (list, tuple)) and not _is_pair(spec) else [spec]
    if not items:
        raise ValueError("targets=[] names no output node; give token ids, strings, (a, b) pairs or CustomTargets")
    out = []
    for item in items:
        if isinstance(item, CustomTarget):
            if tuple(item.direction.shape) != (vocab,):
                raise ValueError(f"CustomTarget {item.name!r}: direction of shape {tuple(item.direction.shape)}, "
                                 f"expected ({vocab},), one weight per vocabulary entry")
            if not -seq <= item.pos < seq:
                raise ValueError(f"CustomTarget {item.name!r}: pos={item.pos} outside the prompt's {seq} positions")
            out.append(OutputTarget(item.name, -1, item.pos % seq, item.direction.detach().float(), float(item.weight)))
        elif _is_pair(item):
            a, b = (_token(model, t, vocab) for t in item)
            direction = torch.zeros(vocab)
            direction[a] += 1
            direction[b] -= 1
            out.append(OutputTarget(f"{_text(model, a)} - {_text(model, b)}", -1, seq - 1, direction, 1.0))
        else:
            token = _token(model, item, vocab)
            direction = torch.full((vocab,), -1.0 / vocab)  # the logit minus the mean logit
            direction[token] += 1
            if any(o.token == token for o in out):
                # One node per token: its id is the token's (the graph file's too), and a list that names
                # it twice ("Mary" and its id, say) is a slip, not a wish for a second, identical row.
                raise ValueError(f"targets name token {token} ({_text(model, token)!r}) twice: give each token once")
            out.append(OutputTarget(_text(model, token), token, seq - 1, direction, float(probs[token])))
    return out


def _is_pair(item) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and all(isinstance(t, (int, str)) for t in item)


def _token(model, item, vocab: int) -> int:
    if isinstance(item, str):
        try:
            return model.to_single_token(item)
        except ValueError as error:
            raise ValueError(f"target {item!r} is not one token ({error})") from None
    if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab:
        raise ValueError(f"target {item!r}: a token id must be an integer in [0, {vocab})")
    return item


def _text(model, token: int) -> str:
    try:
        return model.to_str_tokens([token])[0]
    except ValueError:  # no tokenizer: the id stands for itself
        return str(token)


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
    batch, seq = len(targets), replica.logits.shape[1]
    device = replica.logits.device
    grad_inputs, grad_logits = {}, None
    for b, target in enumerate(targets):
        if target.layer is None:
            if grad_logits is None:
                grad_logits = torch.zeros(batch, *replica.logits.shape[1:], dtype=target.direction.dtype, device=device)
            grad_logits[b, target.pos] = target.direction.to(device)
        else:
            if target.layer not in grad_inputs:
                grad_inputs[target.layer] = torch.zeros(batch, seq, tcs.d_in, dtype=target.direction.dtype, device=device)
            grad_inputs[target.layer][b, target.pos] = target.direction.to(device)
    return grad_inputs, grad_logits


def target_rows(replica: Replica, targets: Sequence[Target], out: Tensor | None = None) -> Float[Tensor, "target source"]:
    """The targets' rows (`Replica.columns`; `out`: a zero [target >= source] block to write them into)."""
    return replica.columns(*directions(replica, targets), out=out)[:len(targets)]


