"""MLPs: the ungated two-projection MLP with a pluggable activation (Arcee's relu², GPT's GELU), and
alpha-er's positional expert MLP."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from hooked_models.components.attention import AttentionInputs
from hooked_models.hooks import HookedModule, ValueHook
from hooked_models.vocabulary import declare_values


class ReLUSquared(nn.Module):
    """relu(x)², as in Primer (So et al. 2021): exactly zero below zero, so an off neuron gets no gradient."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.square(torch.relu(x))


class UngatedMLP(HookedModule):
    """down_proj(act(up_proj(x))): no gate, so `mlp_neurons` is the activation itself."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: nn.Module, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation
        self.mlp_pre_activation = ValueHook("mlp_pre_activation")
        self.mlp_activation = ValueHook("mlp_activation")
        self.mlp_neurons = ValueHook("mlp_neurons")
        self.mlp_output = ValueHook("mlp_output")

    def forward(
        self, x: Float[Tensor, "batch seq hidden_size"], inputs: AttentionInputs | None = None
    ) -> Float[Tensor, "batch seq hidden_size"]:
        # `inputs` (the block passes every MLP the forward's inputs) is not read: each position is its own.
        pre = self.mlp_pre_activation(self.up_proj(x))
        neurons = self.mlp_neurons(self.mlp_activation(self.act_fn(pre)))
        return self.mlp_output(self.down_proj(neurons))

    # TransformerLens's weight views [hidden_size intermediate_size] / [intermediate_size hidden_size]:
    # transposes of the projections, sharing their storage.
    W_in = property(lambda self: self.up_proj.weight.T)
    W_out = property(lambda self: self.down_proj.weight.T)
    b_in = property(lambda self: self.up_proj.bias)
    b_out = property(lambda self: self.down_proj.bias)


# The positional expert MLP's own value, in the vocabulary's form.
EXPERT_VALUES = declare_values("mlp", [
    ("mlp_expert_index", "ExpertIndex",
     "Each token's expert, floor(t·G/T) for position t of a length-T sequence; read-only",
     "inside the forward: the routing", dict(read_only=True, lazy=True)),
])


class ExpertLinear(nn.Module):
    """G independent linear maps, `weight` [expert out_features in_features] (F.linear's layout per expert)."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        self.register_parameter("bias", None)  # [expert out_features]; only `fold_ln` creates one

    def forward(
        self, x: Float[Tensor, "batch expert window in_features"], experts: slice = slice(None)
    ) -> Float[Tensor, "batch expert window out_features"]:
        """Window g of `x` through expert g of `experts` (all of them by default)."""
        out = torch.einsum("bgsi,goi->bgso", x, self.weight[experts])
        return out if self.bias is None else out + self.bias[experts, None, :]

    def extra_repr(self) -> str:
        experts, out_features, in_features = self.weight.shape
        return f"{experts} experts, {in_features} -> {out_features}"


class PositionalExpertMLP(HookedModule):
    """alpha-er's conditional MLP: G experts of width intermediate_size/G, routed by position.

    A token at position t of a length-T sequence goes to expert floor(t·G/T), so the sequence is cut
    into G contiguous windows and window g runs through expert g: one batched einsum per projection,
    as the alpha-er reference computes it. Routing depends on the position only, never on the batch
    (the reference's docstring: routing on the flattened batch index tied the weights to one batch
    shape). T must be a multiple of G.

    `mlp_pre_activation`, `mlp_activation` and `mlp_neurons` keep the standard dense layout
    [batch seq intermediate_size]: neuron n of expert g is index g·width + n, zero outside the
    token's expert. The dense form is built only while a hook reads or writes it; what a hook writes
    flows on, the next step reading each token's own expert slice of it.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, experts: int, activation: nn.Module):
        super().__init__()
        if intermediate_size % experts:
            raise ValueError(f"intermediate_size={intermediate_size} is not a multiple of experts={experts}")
        self.experts, self.width = experts, intermediate_size // experts
        self.up_proj = ExpertLinear(experts, hidden_size, self.width)
        self.down_proj = ExpertLinear(experts, self.width, hidden_size)
        self.act_fn = activation
        self.mlp_expert_index = ValueHook(EXPERT_VALUES["mlp_expert_index"])
        self.mlp_pre_activation = ValueHook("mlp_pre_activation")
        self.mlp_activation = ValueHook("mlp_activation")
        self.mlp_neurons = ValueHook("mlp_neurons")
        self.mlp_output = ValueHook("mlp_output")

    def expert_index(self, seq: int, device=None, start: int = 0, total: int | None = None) -> Tensor:
        """The expert of each of `seq` positions from `start` in a sequence of `total` (default:
        start + seq, the positions are the whole sequence): floor(t·G/T)."""
        total = start + seq if total is None else total
        return torch.arange(start, start + seq, device=device) * self.experts // total

    def forward(
        self, x: Float[Tensor, "batch seq hidden_size"], inputs: AttentionInputs | None = None
    ) -> Float[Tensor, "batch seq hidden_size"]:
        batch, seq, hidden = x.shape
        # A call may be the positions start ... of a longer sequence (`inputs.window`, the earlier
        # positions held by a key/value cache): routing is by absolute position and full length.
        start, total = (0, seq) if inputs is None or inputs.window is None else inputs.window
        if total % self.experts:
            raise ValueError(
                f"sequence length {total} is not a multiple of the MLP's {self.experts} experts: "
                f"the experts own windows of seq/{self.experts} positions"
            )
        if self.mlp_expert_index.has_hooks():
            self.mlp_expert_index(self.expert_index(seq, x.device, start, total).expand(batch, seq))
        # Window g of the sequence (positions g·T/G ... (g+1)·T/G - 1) is expert g's. A call that
        # starts or ends inside a window is padded to whole windows, and the padding dropped after.
        span = total // self.experts
        first, last = start // span, -(-(start + seq) // span)
        lead, tail = start - first * span, last * span - start - seq
        if lead or tail:
            x = F.pad(x, (0, 0, lead, tail))
        experts = slice(first, last)
        windows = x.view(batch, last - first, span, hidden)
        pre = self._dense_hooks(self.up_proj(windows, experts), first, lead, seq, self.mlp_pre_activation)
        neurons = self._dense_hooks(self.act_fn(pre), first, lead, seq, self.mlp_activation, self.mlp_neurons)
        out = self.down_proj(neurons, experts).reshape(batch, (last - first) * span, hidden)
        return self.mlp_output(out[:, lead:lead + seq] if lead or tail else out)

    # TransformerLens's weight views, one matrix per expert (views of the experts' weights): W_in
    # [expert hidden_size width], W_out [expert width hidden_size]. Flattened over (expert, width)
    # they index the dense neurons of `mlp_neurons` (neuron n of expert g is g·width + n).
    W_in = property(lambda self: self.up_proj.weight.transpose(-1, -2))
    W_out = property(lambda self: self.down_proj.weight.transpose(-1, -2))
    b_in = property(lambda self: self.up_proj.bias)  # [expert width], once fold_ln has made one

    def _dense_hooks(
        self, compact: Float[Tensor, "batch expert window width"], first: int, lead: int, seq: int,
        *points: ValueHook,
    ) -> Float[Tensor, "batch expert window width"]:
        """Run `points` in order on the dense form of the call's `seq` positions, if any is hooked
        (`compact` holds windows of experts first ..., its positions from `lead` on); back to each
        token's own slice."""
        if not any(point.has_hooks() for point in points):
            return compact
        windows, span = compact.shape[1:3]
        dense = self.densify(compact, first, self.experts)
        padded = dense.shape[1] != seq
        if padded:
            dense = dense[:, lead:lead + seq]
        for point in points:
            dense = point(dense)
        if padded:
            dense = F.pad(dense, (0, 0, lead, windows * span - lead - seq))
        return self.compact(dense, first, windows)

    @staticmethod
    def densify(
        compact: Float[Tensor, "batch expert window width"], first: int = 0, experts: int | None = None
    ) -> Float[Tensor, "batch seq intermediate_size"]:
        """Each token's expert slice in place in a [batch seq intermediate_size] tensor of zeros.

        Window k of `compact` is expert first + k of `experts` (default: the windows are all of them).
        """
        batch, windows, span, width = compact.shape
        experts = windows if experts is None else experts
        dense = compact.new_zeros(batch, windows, span, experts, width)
        index = torch.arange(windows, device=compact.device)
        # Advanced indices split by a slice put their dimension first: [expert batch window width].
        dense[:, index, :, index + first] = compact.transpose(0, 1)
        return dense.view(batch, windows * span, experts * width)

    def compact(
        self, dense: Float[Tensor, "batch seq intermediate_size"], first: int = 0, windows: int | None = None
    ) -> Float[Tensor, "batch expert window width"]:
        """The inverse of `densify`: each token's own expert slice, whatever is written elsewhere
        (the positions are `windows` whole windows from expert `first`'s; default: all of them)."""
        batch, seq, _ = dense.shape
        windows = self.experts if windows is None else windows
        index = torch.arange(windows, device=dense.device)
        blocks = dense.reshape(batch, windows, seq // windows, self.experts, self.width)
        return blocks[:, index, :, index + first].transpose(0, 1)
