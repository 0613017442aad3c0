"""Shared fixtures: tiny random models whose weights are far from their initial values, so a dropped
norm weight, a missing bias or a forgotten YaRN scale cannot pass."""

import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import ArceeConfig as HFArceeConfig
from transformers import ArceeForCausalLM

# Tiny models gain nothing from intra-op threads, and on a shared 2-core runner the threads' spin
# waits make each small matmul ~100x slower (measured: 0.35 s vs 4 ms per tiny forward).
torch.set_num_threads(1)

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
            if "norm" in name or name.endswith("mid_w") or re.search(r"(^|\.)ln(1|2|_f)\.weight$", name):
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


@pytest.fixture(scope="session")
def explicit_attention():
    """fwd_hooks that send every layer's attention down its explicit path: a hook that reads the
    scores and writes nothing (a filter on names, so it fits any model)."""
    return [(lambda name: name.endswith(".attention_scores"), lambda scores, hook: None)]


@pytest.fixture(scope="session")
def hf_arcee_factory():
    return make_hf_arcee


@pytest.fixture(scope="session")
def tiny_hf_arcee():
    return make_hf_arcee()


@pytest.fixture(scope="session")
def tiny_arcee(tiny_hf_arcee):
    from hooked_models import HookedArcee

    return HookedArcee.from_hf(tiny_hf_arcee)


# ------------------------------------------------------------------------------------------- alpha-er
# The alpha-er reference, transcribed (tests/reference/alpha_er_reference.py): the oracle.
sys.path.insert(0, str(Path(__file__).parent / "reference"))
from alpha_er_reference import (  # noqa: E402
    ReferenceAlphaErConfig,
    ReferenceAlphaErForCausalLM,
)

# A small alpha-er: every dimension distinct where it can be, so a transposed weight cannot pass.
TINY_ALPHA_ER = dict(vocab_size=61, block_size=32, n_layer=2, n_embd=24, n_head=4, ffn_dim=48, mlp_experts=4,
                     lm_head_rank=10, attn_rank=7, attn_soft_cap=30.0, layer_norm_eps=1e-5)


def make_reference_alpha_er(seed: int = 0, **overrides) -> ReferenceAlphaErForCausalLM:
    """The transcribed reference on a random config; every parameter (LayerNorm and bottleneck affine
    terms included) far from its initial value."""
    torch.manual_seed(seed)
    model = ReferenceAlphaErForCausalLM(ReferenceAlphaErConfig(**{**TINY_ALPHA_ER, **overrides}))
    return randomize_(model, seed).eval()


@pytest.fixture
def reference_alpha_er_factory():
    return make_reference_alpha_er


@pytest.fixture(scope="session")
def reference_alpha_er_classes():
    """The transcribed reference's classes (importlib mode: tests cannot import conftest)."""
    return dict(config=ReferenceAlphaErConfig, model=ReferenceAlphaErForCausalLM, tiny=dict(TINY_ALPHA_ER))


@pytest.fixture(scope="session")
def full_size_alpha_er():
    """The reference at its default (released) size with random weights, and its hooked port."""
    from hooked_models import HookedAlphaEr

    # Built on the meta device and materialized uninitialized: randomize_ overwrites every parameter.
    with torch.device("meta"):
        reference = ReferenceAlphaErForCausalLM(ReferenceAlphaErConfig())
    reference = randomize_(reference.to_empty(device="cpu"), 0).eval()
    return reference, HookedAlphaEr.from_reference(reference)


# Families, as tiny random hooked models for the TransformerLens-compatibility tests (GQA: 4 query
# heads over 2 key/value heads, so head indexing mistakes show).
TL_TINY_ARCEE = dict(vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=4)


def make_tl_family_model(family: str, seed: int = 0):
    if family == "arcee":
        from hooked_models import HookedArcee

        return HookedArcee.from_hf(make_hf_arcee(seed, **TL_TINY_ARCEE))
    if family == "alpha_er":
        from hooked_models import HookedAlphaEr

        return HookedAlphaEr.from_reference(make_reference_alpha_er(seed))
    raise ValueError(family)


def reference_heads(model, layer: int, part: str, stream: torch.Tensor) -> torch.Tensor:
    """An oracle for split inputs: `part` ("q", "k", "v") of every head of `layer` computed from the whole
    `stream` [batch seq hidden_size] through the block's input_layernorm and the attention's own
    projection (alpha-er: its factored qkv_proj), [batch heads seq head_dim], before rotary."""
    block = model.layers[layer]
    attn = block.self_attn
    x = block.input_layernorm(stream)
    batch, seq, _ = x.shape
    if hasattr(attn, "qkv_proj"):  # alpha-er: one factored projection, q, k, v in that order
        out = attn.qkv_proj(x).split(attn.num_heads * attn.head_dim, dim=-1)["qkv".index(part)]
    else:
        out = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj}[part](x)
    return out.view(batch, seq, -1, attn.head_dim).transpose(1, 2)


def projected_name(model, layer: int, part: str) -> str:
    """The value holding one part's per-head projections, before rotary where the family has rotary."""
    base = {"q": "attention_queries", "k": "attention_keys", "v": "attention_values"}[part]
    name = f"layers.{layer}.self_attn.{base}"
    return name + "_unrotated" if part != "v" and name + "_unrotated" in model.hook_dict else name


@pytest.fixture(scope="session")
def split_oracle():
    """(reference_heads, projected_name): tests cannot import conftest under importlib mode."""
    return reference_heads, projected_name


@pytest.fixture(params=["arcee", "alpha_er"])
def tl_family(request):
    return request.param


@pytest.fixture(scope="session")
def tl_model_factory():
    return make_tl_family_model


@pytest.fixture
def tl_model(tl_family):
    return make_tl_family_model(tl_family)


@pytest.fixture(scope="session")
def tiny_factories():
    """The builders of the tiny random references (transformers' Arcee, the alpha-er transcription),
    for module-scoped fixtures that build their own copies."""
    return make_hf_arcee, make_reference_alpha_er


def randomize_transcoder_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter of a transcoder random and away from zero (biases too; JumpReLU thresholds positive)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
            if "threshold" in name:
                p.abs_()
    return module


@pytest.fixture(scope="session")
def random_transcoder_():
    """`randomize_transcoder_` (tests cannot import conftest under importlib mode)."""
    return randomize_transcoder_


# ------------------------------------------------------------------------------------------- progress
class ProgressProbe:
    """A `progress=` callable that records every Step and raises `Cancelled` at the `cancel_at`-th one."""

    def __init__(self, cancel_at: int | None = None):
        self.steps, self.cancel_at = [], cancel_at

    def __call__(self, step) -> None:
        from hooked_models.progress import Cancelled

        self.steps.append(step)
        if len(self.steps) == self.cancel_at:
            raise Cancelled(f"cancelled at step {len(self.steps)}")

    def check_complete(self, unit: str) -> None:
        """The steps count up (never back), in one total and `unit`, and the last is all the work."""
        assert self.steps, "the callable saw no step"
        done = [s.done for s in self.steps]
        assert done == sorted(done) and len({s.total for s in self.steps}) == 1, self.steps
        assert {s.unit for s in self.steps} == {unit}
        assert self.steps[-1].done == self.steps[-1].total > 0


def hooks_left(model: torch.nn.Module) -> list[str]:
    """Every module that still has a hook of any kind: TransformerLens's lists and torch's own dicts."""
    left = []
    for name, module in model.named_modules():
        kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
        if any(getattr(module, kind, None) for kind in kinds) or getattr(module, "fwd_hooks", None) \
                or getattr(module, "bwd_hooks", None):
            left.append(name)
    return left


class ProgressChecks:
    """What every long function's `progress=` must do (tests cannot import conftest under importlib mode)."""

    Probe = ProgressProbe

    @staticmethod
    def check_cancelled(model, tokens: torch.Tensor, run, cancel_at: int = 2) -> ProgressProbe:
        """`run(progress)` with a probe cancelling at its `cancel_at`-th step: `Cancelled` reaches the caller,
        no step comes after it, no hook stays on the model, and its logits are as before, bit for bit."""
        from hooked_models.progress import Cancelled

        with torch.no_grad():
            before = model(tokens)
        assert hooks_left(model) == []
        probe = ProgressProbe(cancel_at)
        with pytest.raises(Cancelled):
            run(probe)
        assert len(probe.steps) == cancel_at and probe.steps[-1].done < probe.steps[-1].total, probe.steps
        assert hooks_left(model) == []
        with torch.no_grad():
            assert torch.equal(model(tokens), before)
        return probe


@pytest.fixture(scope="session")
def progress_checks():
    return ProgressChecks
