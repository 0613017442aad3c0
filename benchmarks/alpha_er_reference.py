"""HookedAlphaEr against the alpha-er reference arithmetic: the benchmark.

    python benchmarks/alpha_er_reference.py       # the released size: 2 layers x 1024, 64 experts

The reference is the plain-torch transcription the tests use as their oracle
(tests/reference/alpha_er_reference.py), so the timing compares the hooked port with the reference's
own arithmetic, not with another port.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))
from alpha_er_reference import ReferenceAlphaErConfig, ReferenceAlphaErForCausalLM  # noqa: E402

def compare_alpha_er(args) -> dict[str, tuple[float, float]]:
    """HookedAlphaEr vs the reference at the released size (random weights), batch x seq as given
    (seq rounded down to a multiple of the 64 experts)."""
    from benchmarks.common import interleaved, randomize_, report
    from hooked_models import HookedAlphaEr

    cfg = ReferenceAlphaErConfig()
    seq = max(cfg.mlp_experts, args.seq // cfg.mlp_experts * cfg.mlp_experts)
    torch.manual_seed(0)
    reference = randomize_(ReferenceAlphaErForCausalLM(cfg)).eval()
    hooked = HookedAlphaEr.from_reference(reference)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(hooked(tokens), reference(tokens), rtol=1e-4, atol=1e-4)
        medians = interleaved({
            "alpha-er reference": lambda: reference(tokens),
            "HookedAlphaEr": lambda: hooked(tokens),
        }, args.rounds)
    report(f"alpha-er forward, released size, batch {args.batch} x {seq}, no hooks", medians,
           "alpha-er reference")
    return medians


if __name__ == "__main__":
    from benchmarks.common import Results, bench_args, timings

    args = bench_args(__doc__.splitlines()[0])
    record = Results(args.results)
    record.save({"alpha_er": timings(compare_alpha_er(args))})
