"""TransformerLens's per-head weight layouts, as views on the stored `[out, in]` weights.

Components store every projection in the layout `F.linear` computes fastest; TransformerLens reads
`W_Q [head hidden_size head_dim]`, `W_O [head head_dim hidden_size]` and `FactoredMatrix` products.
These helpers sit below both the components (which expose the views) and
hooked_models/transformer_lens_compat.py (which stacks them), so neither imports the other.
"""

from jaxtyping import Float
from torch import Tensor
from transformer_lens.FactoredMatrix import FactoredMatrix

__all__ = ["FactoredMatrix", "per_head_in", "per_head_out"]


def per_head_in(weight: Float[Tensor, "heads_by_dim hidden_size"], heads: int) -> Tensor:
    """An [out, in] projection into heads -> TransformerLens's [head hidden_size head_dim] (a view)."""
    return weight.view(heads, -1, weight.shape[-1]).transpose(-1, -2)


def per_head_out(weight: Float[Tensor, "hidden_size heads_by_dim"], heads: int) -> Tensor:
    """An [out, in] projection out of heads -> TransformerLens's [head head_dim hidden_size] (a view)."""
    return weight.view(weight.shape[0], heads, -1).permute(1, 2, 0)
