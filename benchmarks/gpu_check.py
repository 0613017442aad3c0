"""CUDA checks to run where a GPU is lent (a minute or two on one GPU):

    python benchmarks/gpu_check.py

- bf16 on cuda: HookedArcee's fused path against transformers' "sdpa", its explicit path (scores
  hooked) against transformers' "eager", both loaded with from_pretrained(dtype=bfloat16);
- fused vs explicit on our side, float32 and bfloat16;
- forward time against transformers at the benchmark shape (8 layers x 1024, batch 4 x 256), bf16;
- with 2+ GPUs: n_devices=2 gives the logits of one GPU, and each layer sits on its GPU.
Prints one line per check and exits non-zero if one fails.
"""

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from transformers import ArceeForCausalLM  # noqa: E402

from benchmarks.common import hf_arcee_config, randomize_  # noqa: E402
from hooked_models import HookedArcee  # noqa: E402

FAILED = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        FAILED.append(name)


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main():
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible")
    args = type("Args", (), dict(layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=4096,
                                 vocab=32000))()
    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="gpu_check_")
    randomize_(ArceeForCausalLM(hf_arcee_config(args, "sdpa"))).save_pretrained(directory)
    ids = torch.randint(3, args.vocab, (4, 256), generator=torch.Generator().manual_seed(0)).cuda()
    scores = [(f"layers.{i}.self_attn.attention_scores", lambda t, hook: None) for i in range(args.layers)]

    # bf16: kernels may differ between the two sides on a GPU (repeat_kv vs enable_gqa), ~1e-2 at most.
    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)]:
        model = HookedArcee.from_pretrained(directory, dtype=dtype, device="cuda")
        with torch.inference_mode():
            fused = model(ids)
            explicit = model.run_with_hooks(ids, fwd_hooks=scores)
            for impl, ours in [("sdpa", fused), ("eager", explicit)]:
                hf = ArceeForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=impl).cuda().eval()
                theirs = hf(ids).logits
                check(f"{dtype} {impl}: logits vs transformers", rel(ours, theirs) <= tol, f"rel {rel(ours, theirs):.2e}")
                if impl == "sdpa" and dtype == torch.bfloat16:
                    timings = {"transformers": [], "HookedArcee": []}
                    for _ in range(6):
                        for name, fn in [("transformers", lambda: hf(ids).logits), ("HookedArcee", lambda: model(ids))]:
                            torch.cuda.synchronize()
                            start = time.perf_counter()
                            fn()
                            torch.cuda.synchronize()
                            timings[name].append(time.perf_counter() - start)
                    t_hf, t_ours = (sorted(v[1:])[len(v[1:]) // 2] for v in timings.values())
                    print(f"     bf16 forward 4 x 256: transformers {t_hf * 1e3:.1f} ms, HookedArcee {t_ours * 1e3:.1f} ms "
                          f"({t_ours / t_hf:.3f}x)")
                del hf
            check(f"{dtype}: fused vs explicit", rel(explicit, fused) <= (1e-5 if dtype == torch.float32 else 2e-2),
                  f"rel {rel(explicit, fused):.2e}")
        del model
        torch.cuda.empty_cache()

    if torch.cuda.device_count() >= 2:
        one = HookedArcee.from_pretrained(directory, device="cuda:0")
        two = HookedArcee.from_pretrained(directory, n_devices=2)
        layout = [two.layers[i].mlp.up_proj.weight.device.index for i in range(args.layers)]
        check("n_devices=2: layer placement", layout == [0] * 4 + [1] * 4, str(layout))
        with torch.inference_mode():
            check("n_devices=2: logits equal one GPU's", rel(two(ids).cpu(), one(ids).cpu()) <= 1e-5)
            _, cache = two.run_with_cache(ids)
            check("n_devices=2: cache on each layer's GPU", cache["blocks.7.hook_resid_pre"].device.index == 1)
    else:
        print("skip n_devices: only one GPU visible")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
