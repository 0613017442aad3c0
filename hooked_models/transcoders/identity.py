"""What a transcoder reads and writes, and the model it was trained for.

A transcoder of layer l reads `layers.{l}.mlp_input` (the normed stream the MLP is called with) and writes
`layers.{l}.mlp.mlp_output`; a set records the model's family, hidden size and layer count, and any model
that differs in one of them is refused.
"""

from dataclasses import asdict, dataclass

# The hooks a transcoder of layer l reads and writes, relative to `layers.{l}` (circuit-tracer's config
# names its hooks relative to the block too: "hook_resid_mid", "mlp.hook_out").
FEATURE_INPUT_HOOK = "mlp_input"
FEATURE_OUTPUT_HOOK = "mlp.mlp_output"


def input_hook_name(layer: int) -> str:
    """The value a transcoder of `layer` reads: the normed stream the MLP is called with."""
    return f"layers.{layer}.{FEATURE_INPUT_HOOK}"


def output_hook_name(layer: int) -> str:
    """The value a transcoder of `layer` writes: what the MLP adds to the residual stream."""
    return f"layers.{layer}.{FEATURE_OUTPUT_HOOK}"


@dataclass(frozen=True)
class ModelIdentity:
    """The model a transcoder set was trained for: family, hidden size, layer count. A set is refused by
    any model that differs in one of them."""

    family: str
    hidden_size: int
    num_layers: int

    @classmethod
    def of(cls, model) -> "ModelIdentity":
        from hooked_models.families.alpha_er import HookedAlphaEr
        from hooked_models.families.arcee import HookedArcee

        family = {HookedArcee: "arcee", HookedAlphaEr: "alpha_er"}.get(type(model))
        if family is None:
            raise ValueError(f"{type(model).__name__} is not a hooked model (HookedArcee or HookedAlphaEr)")
        return cls(family, model.cfg.hidden_size, model.cfg.num_layers)

    def check(self, model, what: str = "these transcoders") -> None:
        """Raise a ValueError naming the first field where `model` differs from this identity."""
        other = ModelIdentity.of(model)
        for field, mine in asdict(self).items():
            theirs = getattr(other, field)
            if mine != theirs:
                raise ValueError(f"{what} were trained for the {self.family} model with hidden_size="
                                 f"{self.hidden_size}, num_layers={self.num_layers}; this model has "
                                 f"{field}={theirs!r} (expected {mine!r})")

