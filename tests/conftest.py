"""Shared fixtures: tiny random models whose weights are far from their initial values, so a dropped
norm weight, a missing bias or a forgotten YaRN scale cannot pass."""

import pytest
import torch
from transformers import ArceeConfig as HFArceeConfig
from transformers import ArceeForCausalLM

TINY_ARCEE = dict(
    vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=10,
    num_key_value_heads=2, head_dim=6, max_position_embeddings=256, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 16,
                     "rope_theta": 10000.0},
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random; norm weights around 1 with spread, not at 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            if "norm" in name or name.endswith("mid_w"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias") or name.endswith("mid_b"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / max(p.shape[-1], 1) ** 0.5)
    return model


def make_hf_arcee(seed: int = 0, **overrides) -> ArceeForCausalLM:
    """transformers' ArceeForCausalLM on a tiny random config: the oracle."""
    config = HFArceeConfig(**{**TINY_ARCEE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_(ArceeForCausalLM(config), seed).eval()


@pytest.fixture
def hf_arcee_factory():
    return make_hf_arcee


@pytest.fixture(scope="session")
def tiny_hf_arcee():
    return make_hf_arcee()


@pytest.fixture(scope="session")
def tiny_arcee(tiny_hf_arcee):
    from hooked_models import HookedArcee

    return HookedArcee.from_hf(tiny_hf_arcee)
