"""The alpha-er reference implementation (shared/seeds/004_*.txt), transcribed into plain torch: the
oracle the hooked port is tested against (tests/conftest.py) and benchmarked against
(benchmarks/alpha_er_reference.py). Kept as the seed writes it; only the names carry a Reference prefix.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


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
