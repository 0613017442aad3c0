"""Shared fixtures: tiny random models whose weights are far from their initial values, so a dropped
norm weight, a missing bias or a forgotten YaRN scale cannot pass."""

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
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


# ------------------------------------------------------------------------------------------- alpha-er
# The alpha-er reference (shared/seeds/004_*.txt), transcribed: the oracle the hooked port is tested
# against. Kept as the seed writes it; only the names carry a Reference prefix.
class ReferenceAlphaErConfig:
    """Mirrors the trainer's ModelConfig. Field names match the checkpoint header."""

    model_type = "alpha-er"

    def __init__(self, vocab_size: int = 12288, block_size: int = 512, n_layer: int = 2, n_embd: int = 1024,
                 n_head: int = 8, ffn_dim: int = 20480, mlp_experts: int = 64, lm_head_rank: int = 128,
                 attn_rank: int = 128, attn_soft_cap: float = 30.0, layer_norm_eps: float = 1e-5, **kwargs):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer
        self.n_embd = n_embd
        self.n_head = n_head
        self.ffn_dim = ffn_dim
        self.mlp_experts = mlp_experts
        self.lm_head_rank = lm_head_rank
        self.attn_rank = attn_rank
        self.attn_soft_cap = attn_soft_cap
        self.layer_norm_eps = layer_norm_eps
        for k, v in kwargs.items():
            setattr(self, k, v)


def reference_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class ReferenceFactoredProjection(nn.Module):
    """x @ down.T -> LayerNorm on the rank-r bottleneck -> @ up.T."""

    def __init__(self, d_in: int, rank: int, d_out: int, eps: float):
        super().__init__()
        self.down = nn.Parameter(torch.empty(rank, d_in))
        self.mid_w = nn.Parameter(torch.ones(rank))
        self.mid_b = nn.Parameter(torch.zeros(rank))
        self.up = nn.Parameter(torch.empty(d_out, rank))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.linear(x, self.down)
        z = F.layer_norm(z, (z.shape[-1],), self.mid_w, self.mid_b, self.eps)
        return F.linear(z, self.up)


class ReferenceAlphaErBlock(nn.Module):
    def __init__(self, cfg: ReferenceAlphaErConfig):
        super().__init__()
        self.cfg = cfg
        d, r = cfg.n_embd, cfg.attn_rank
        self.ln1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.qkv = ReferenceFactoredProjection(d, r, 3 * d, cfg.layer_norm_eps)
        self.proj = ReferenceFactoredProjection(d, r, d, cfg.layer_norm_eps)
        self.ln2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        G, fe = cfg.mlp_experts, cfg.ffn_dim // cfg.mlp_experts
        self.fc1s = nn.Parameter(torch.empty(G, fe, d))
        self.fc2s = nn.Parameter(torch.empty(G, d, fe))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        H = self.cfg.n_head
        hd = d // H
        a = self.ln1(x)
        q, k, v = self.qkv(a).split(d, dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)
        k = k.view(B, T, H, hd).transpose(1, 2)
        v = v.view(B, T, H, hd).transpose(1, 2)
        cap = self.cfg.attn_soft_cap
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if cap and cap > 0:
            scores = torch.tanh(scores / cap) * cap
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        G = self.cfg.mlp_experts
        S = T // G
        b = self.ln2(x).view(B, G, S, d)
        h = reference_gelu(torch.einsum("bgsd,gfd->bgsf", b, self.fc1s))
        y = torch.einsum("bgsf,gdf->bgsd", h, self.fc2s).reshape(B, T, d)
        return x + y


class ReferenceAlphaErForCausalLM(nn.Module):
    def __init__(self, cfg: ReferenceAlphaErConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([ReferenceAlphaErBlock(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.lm_head = ReferenceFactoredProjection(cfg.n_embd, cfg.lm_head_rank, cfg.vocab_size, cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        if T % self.cfg.mlp_experts != 0:
            raise ValueError(
                f"sequence length {T} must be a multiple of mlp_experts="
                f"{self.cfg.mlp_experts}: the expert boundaries fall at multiples "
                f"of T/G, so pad the input to block_size ({self.cfg.block_size}) "
                f"and read the logits at the last real position."
            )
        pos = torch.arange(T, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens=64, temperature=0.8, top_k=40):
        cfg = self.cfg
        ids = input_ids[0].tolist()
        for _ in range(max_new_tokens):
            window = ids[-cfg.block_size:]
            padded = window + [0] * (cfg.block_size - len(window))
            t = torch.tensor([padded], device=input_ids.device)
            logits = self(t)[0, len(window) - 1]
            if temperature <= 0:
                ids.append(int(logits.argmax()))
                continue
            v, i = torch.topk(logits, min(top_k, logits.numel()))
            p = torch.softmax(v / temperature, dim=-1)
            ids.append(int(i[torch.multinomial(p, 1)]))
        return torch.tensor([ids], device=input_ids.device)


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


@pytest.fixture(params=["arcee", "alpha_er"])
def tl_family(request):
    return request.param


@pytest.fixture
def tl_model_factory():
    return make_tl_family_model


@pytest.fixture
def tl_model(tl_family):
    return make_tl_family_model(tl_family)
