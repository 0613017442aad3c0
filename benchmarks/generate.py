"""Tokens per second: HookedArcee.generate against transformers' generate, on the same random weights.

    python benchmarks/generate.py --threads 1           # CPU, float32, 4 layers x 512 wide
    python benchmarks/generate.py --device cuda --dtype bfloat16 --batch 8

Greedy decoding of `--new` tokens after a `--prompt`-token prompt, with a key/value cache on both
sides (transformers' DynamicCache, ours `KeyValueCache`), EOS off so every run decodes the same
number of tokens. Each repetition runs the four cases back to back (interleaved, so drift in clock
or load hits them alike): transformers, transformers with a PyTorch forward hook that adds a
steering vector after layer 1, HookedArcee, and HookedArcee with the same steering as a hook on
`layers.1.layer_output`. Prints the median tokens/s of each (CPU time of this process on the CPU,
wall clock on a GPU) and the ratios, and writes them to benchmarks/results/generate.json. Not a test:
timings belong here, never in an assertion.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import ArceeConfig as HFArceeConfig
from transformers import ArceeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Results  # noqa: E402
from hooked_models import HookedArcee  # noqa: E402


def build(args) -> tuple[ArceeForCausalLM, HookedArcee]:
    heads = args.width // 64
    config = HFArceeConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
        head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hf = ArceeForCausalLM(config).to(device=args.device, dtype=dtype).eval()
    return hf, HookedArcee.from_hf(hf, dtype=dtype, device=args.device)


def timed(fn, device) -> float:
    """Seconds of one call: CPU time of this process on the CPU (steady on a shared machine, with --threads 1),
    wall clock on a GPU (after synchronizing)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start
    start = time.process_time()
    fn()
    return time.process_time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--results", default="generate",
                        help="write the figures to benchmarks/results/RESULTS.json (default: %(default)s)")
    args = parser.parse_args()
    record = Results(args.results)
    if args.threads:
        torch.set_num_threads(args.threads)

    hf, model = build(args)
    tokens = torch.randint(2, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(args.device)
    steer = 0.1 * torch.randn(args.width, generator=torch.Generator().manual_seed(1)).to(args.device, hf.dtype)

    def hf_generate():
        return hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                           max_new_tokens=args.new)

    def hf_hooked():
        handle = hf.model.layers[1].register_forward_hook(
            lambda module, inputs, output: output + steer if isinstance(output, torch.Tensor)
            else (output[0] + steer, *output[1:]))
        try:
            return hf_generate()
        finally:
            handle.remove()

    def ours():
        return model.generate(tokens, max_new_tokens=args.new, temperature=0, stop_at_eos=False, verbose=False)

    def ours_hooked():
        return model.generate(tokens, max_new_tokens=args.new, temperature=0, stop_at_eos=False, verbose=False,
                              fwd_hooks=[("layers.1.layer_output", lambda x, hook: x + steer)])

    cases = {"transformers": hf_generate, "transformers + hook": hf_hooked,
             "HookedArcee": ours, "HookedArcee + hook": ours_hooked}
    with torch.no_grad():
        same = torch.equal(hf_generate(), ours()) and torch.equal(hf_hooked(), ours_hooked())  # also a warm-up
        seconds = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, fn in cases.items():
                seconds[name].append(timed(fn, args.device))

    generated = args.batch * args.new
    rate = {name: generated / statistics.median(s) for name, s in seconds.items()}
    print(f"{args.layers} layers x {args.width} wide, vocab {args.vocab}, {args.dtype} on {args.device}; "
          f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens; median of {args.reps} interleaved runs "
          f"({'wall clock' if args.device.startswith('cuda') else 'CPU time'}, {torch.get_num_threads()} threads)")
    print(f"greedy outputs identical (plain and steered): {same}")
    for name, r in rate.items():
        print(f"  {name:<22} {r:10.1f} tokens/s")
    print(f"  HookedArcee / transformers                 {rate['HookedArcee'] / rate['transformers']:.2f}")
    print(f"  HookedArcee + hook / transformers + hook   "
          f"{rate['HookedArcee + hook'] / rate['transformers + hook']:.2f}")
    print(f"  HookedArcee + hook / HookedArcee           {rate['HookedArcee + hook'] / rate['HookedArcee']:.2f}")
    record.save({"shape": {k: getattr(args, k) for k in ("layers", "width", "vocab", "batch", "prompt", "new", "reps",
                                                         "dtype", "device")},
                 "identical_outputs": same, "tokens_per_s": {name: round(r, 2) for name, r in rate.items()}})


if __name__ == "__main__":
    main()
