"""Rotary position embeddings: the default schedule and YaRN.

The arithmetic follows transformers' `modeling_rope_utils` (`_compute_default_rope_parameters`,
`_compute_yarn_parameters`) and `LlamaRotaryEmbedding.forward`, step for step, so that cos and sin
agree bit for bit in float32.
"""

import math
import torch
from jaxtyping import Float, Int
from torch import Tensor

from hooked_models.config import ROPE_TYPES, RopeConfig
from hooked_models.hooks import HookedModule

__all__ = ["ROPE_TYPES", "RopeConfig", "RotaryEmbedding", "apply_rotary", "rope_frequencies", "rotate_half"]

def rope_frequencies(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """Inverse frequencies [dim/2] and the factor cos and sin are scaled by."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    pos_freqs = rope.theta**exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0

    factor = rope.factor
    if factor is None:
        factor = max_position_embeddings / rope.original_max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    # YaRN scales cos and sin by 0.1·ln(factor) + 1 unless attention_factor is given.
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)

    # Low frequencies are interpolated (divided by factor), high ones kept, with a linear ramp between.
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_share = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share
    return inv_freq, attention_factor


class RotaryEmbedding(HookedModule):
    """cos and sin for each position of each row; positions may differ per row (padding)."""

    def __init__(self, rope: RopeConfig, dim: int, max_position_embeddings: int):
        super().__init__()
        self.rope, self.dim = rope, dim
        # Kept off the state dict and computed on the CPU, so a model built on the meta device
        # still has real frequencies; moved to the positions' device on first use.
        self._inv_freq, self.attention_scaling = rope_frequencies(rope, dim, max_position_embeddings)
        self._per_device: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        if device not in self._per_device:
            self._per_device[device] = self._inv_freq.to(device)
        return self._per_device[device]

    def forward(
        self, positions: Int[Tensor, "batch seq"], dtype: torch.dtype
    ) -> tuple[Float[Tensor, "batch seq head_dim"], Float[Tensor, "batch seq head_dim"]]:
        freqs = positions[..., None].float() * self.inv_freq(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)

    def extra_repr(self) -> str:
        if self.rope.rope_type == "default":
            return f"default, theta={self.rope.theta}"
        return (f"yarn, theta={self.rope.theta}, factor={self.rope.factor}, "
                f"original_max_position_embeddings={self.rope.original_max_position_embeddings}, "
                f"attention_scaling={self.attention_scaling:.4f}")


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: Float[Tensor, "batch heads seq head_dim"],
    cos: Float[Tensor, "batch seq head_dim"],
    sin: Float[Tensor, "batch seq head_dim"],
) -> Float[Tensor, "batch heads seq head_dim"]:
    """x * cos + rotate_half(x) * sin, the reference's arithmetic, with its bits: each half's second
    term, x2 * sin (negated: a + (-b) is a - b in IEEE arithmetic) and x1 * sin, is added in place
    to x * cos, so neither the rotated copy nor a third full-size product is made."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out
