"""Forward and run_with_cache speed beside the peers, on the same random weights, interleaved.

    python benchmarks/forward.py                  # 8 layers x 1024 wide GQA, batch 4 x 256, float32
    python benchmarks/forward.py --layers 2 --hidden 256 --intermediate 1024 --vocab 4096  # quick look

Contenders:
- forward, no hooks: HookedArcee vs transformers' ArceeForCausalLM (sdpa). Target <= 1.05x.
- run_with_cache of every hook: HookedArcee vs TransformerLens 4.3's TransformerBridge booted
  offline from the same weights saved to a temporary directory. Target <= 0.8x. Beside them, the
  same matrix multiplications alone (`gemm_floor`): the floor under any implementation.
- HookedAlphaEr forward vs the plain-torch reference (benchmarks/alpha_er_reference.py), released size.
Every pair is checked to give the same logits before it is timed. The medians go to
benchmarks/results/forward.json (`--results NAME` for another file), the source of the READMEs' figures.
"""

import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from transformers import ArceeForCausalLM  # noqa: E402

from benchmarks.common import Results, bench_args, hf_arcee_config, interleaved, randomize_, report, timings  # noqa: E402
from hooked_models import HookedArcee  # noqa: E402


def boot_bridge(hf_model):
    """TransformerLens 4.3's bridge over the same weights, booted from a local directory (no network)."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tempfile.mkdtemp(prefix="bench_bridge_")
    hf_model.save_pretrained(directory)
    _stub_tokenizer(hf_model.config.vocab_size).save_pretrained(directory)
    return TransformerBridge.boot_transformers(directory, device="cpu", dtype=torch.float32)


def _stub_tokenizer(vocab_size: int):
    """The bridge wants a tokenizer; the benchmark feeds tokens, so a tiny word-level one serves."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0",
                                   unk_token="t0")


def main():
    args = bench_args(__doc__.splitlines()[0])
    record = Results(args.results)
    figures = {"shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                       "intermediate", "vocab", "batch", "seq", "rounds")}}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model: {args.layers} layers x "
          f"{args.hidden} wide, {args.heads}/{args.kv_heads} heads of {args.head_dim}, MLP {args.intermediate}, "
          f"vocab {args.vocab}; batch {args.batch} x {args.seq}, float32")
    torch.manual_seed(0)
    hf = randomize_(ArceeForCausalLM(hf_arcee_config(args, "sdpa"))).eval()
    hooked = HookedArcee.from_hf(hf)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    with torch.inference_mode():
        torch.testing.assert_close(hooked(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
        medians = interleaved({
            "transformers ArceeForCausalLM (sdpa)": lambda: hf(tokens).logits,
            "HookedArcee": lambda: hooked(tokens),
        }, args.rounds)
    report("forward, no hooks", medians, "transformers ArceeForCausalLM (sdpa)", "HookedArcee <= 1.05x")
    figures["forward"] = timings(medians)

    bridge = boot_bridge(hf)
    with torch.inference_mode():
        logits, cache = hooked.run_with_cache(tokens)
        bridge_logits, bridge_cache = bridge.run_with_cache(tokens)
        torch.testing.assert_close(logits, bridge_logits, rtol=1e-4, atol=1e-4)
        counts = f"HookedArcee caches {len(cache)} values, the bridge {len(bridge_cache)}"
        figures["cached_values"] = {"HookedArcee": len(cache), "TransformerBridge": len(bridge_cache)}
        del cache, bridge_cache
        medians = interleaved({
            "TransformerBridge.run_with_cache": lambda: bridge.run_with_cache(tokens),
            "HookedArcee.run_with_cache": lambda: hooked.run_with_cache(tokens),
            "the same matmuls alone (a floor)": gemm_floor(hf, tokens),
        }, args.rounds)
    report(f"run_with_cache, every hook ({counts})", medians, "TransformerBridge.run_with_cache",
           "HookedArcee <= 0.8x")
    figures["run_with_cache"] = timings(medians)
    del bridge

    figures["alpha_er"] = alpha_er(args)
    record.save(figures)


def gemm_floor(hf, tokens):
    """Every matrix multiplication a cached forward does (the projections, the MLP, the explicit
    attention's two batched products, the unembedding), on inputs of the right shapes and nothing
    else: no norm, rotary, softmax, hook or cache. Any implementation that gives transformers'
    numbers runs these, with torch's BLAS, so their time is a floor under any run_with_cache."""
    cfg = hf.config
    batch, seq = tokens.shape
    weights = [p for name, p in hf.named_parameters() if p.dim() == 2 and "embed_tokens" not in name]
    lm_head = hf.get_output_embeddings().weight
    if all(w is not lm_head for w in weights):  # tied: the unembedding is the embedding
        weights.append(lm_head)
    generator = torch.Generator().manual_seed(2)
    inputs = {w.shape[1]: torch.randn(batch, seq, w.shape[1], generator=generator) for w in weights}
    q = torch.randn(batch, cfg.num_attention_heads, seq, cfg.head_dim, generator=generator)
    k, v = torch.randn_like(q), torch.randn_like(q)

    def run():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
        for _ in range(cfg.num_hidden_layers):
            torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v)

    return run


def alpha_er(args) -> dict:
    """HookedAlphaEr vs the reference arithmetic: the medians, as JSON."""
    from benchmarks.alpha_er_reference import compare_alpha_er

    return timings(compare_alpha_er(args))


if __name__ == "__main__":
    main()
