"""circuit-tracer on alpha-er: what its nnsight backend can compute of alpha-er, against ours.

    python benchmarks/circuit_tracer_alpha_er.py --threads 1          # needs .ci/ct-env (bash .ci/ct-env.sh)

The alpha-er case beside benchmarks/circuit_tracer_compare.py's Arcee ones, in two halves the same way:
`--side` runs in .ci/ct-env (circuit-tracer 0.5.0, nnsight 0.6.3, transformers 4.57.3) and imports nothing of
this package. It loads AlphaErForCausalLM from the checkpoint's own source files (remote code: circuit-tracer
reads the config without trust_remote_code, so the two classes are registered with the Auto classes first),
registers an nnsight mapping for it, loads our random JumpReLU transcoders (circuit_tracer_compare's, saved in
its layout) with its own `load_transcoder_set`, and runs `get_activations`: the logits and every transcoder's
activations at every position.

What can be compared is that forward, not the graph. circuit-tracer's linearisation cannot express alpha-er:
- it freezes a norm's scale by detaching one operation inside it (Llama's RMSNorm: `mean_0`); alpha-er's
  LayerNorms (ln1, ln2, ln_f and each factored projection's bottleneck norm) are each one F.layer_norm call,
  with no operation holding the scale alone, so none can be frozen and every edge would carry LayerNorm
  Jacobians that our graph freezes;
- it injects each logit's vector, a row of a [vocab, hidden] `unembed_weight`, at the base model's output;
  the factored head up(LayerNorm(down(x))) has no such matrix (with its bottleneck scale frozen it is a
  different matrix at each position), and `attribute` stops there;
- its embedding node is `embed_tokens`: the learned positions would be a second source it has no node for.
So the mapping below names the attention pattern (the eager attention's dropout, as Llama's), the MLP's input
and output for the transcoders, and `lm_head.up_proj.weight` only to be well-formed: `get_activations` reads
no unembedding. The figures: logits equal, the active features (layer, position, index) and their activations
equal at every position but 0 (circuit-tracer zeroes position 0, the BOS, as in the Arcee comparison), and the
time ratio of that forward. No results file: the test (tests/test_circuit_tracer_alpha_er.py) runs it live.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The Arcee comparison's helpers; importing it imports nothing of hooked_models (the side half needs that).
from benchmarks.circuit_tracer_compare import (  # noqa: E402
    SIDE_PYTHON,
    jumprelu_transcoders,
    side_model,
    side_parser,
    timed,
)

PROMPT = "When Mary and John went to the store together, John gave a drink to"   # 16 tokens: block_size


def side(args) -> None:
    """circuit-tracer's forward with our transcoders, in the side environment (imports nothing of hooked_models)."""
    from circuit_tracer.utils import tl_nnsight_mapping
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config_class = get_class_from_dynamic_module("configuration_alpha_er.AlphaErConfig", str(args.model))
    AutoConfig.register(config_class.model_type, config_class)
    AutoModelForCausalLM.register(config_class, get_class_from_dynamic_module(
        "modeling_alpha_er.AlphaErForCausalLM", str(args.model)))
    tl_nnsight_mapping._register(tl_nnsight_mapping.ModelMapping(
        model_architecture="AlphaErForCausalLM",
        attention_location_pattern=("model.layers[{layer}].self_attn.source.attention_interface_0.source."
                                    "nn_functional_dropout_0"),
        layernorm_scale_location_patterns=[],   # nothing to detach: each LayerNorm is one F.layer_norm call
        pre_logit_location="model",
        embed_location="model.embed_tokens",
        embed_weight="model.embed_tokens.weight",
        unembed_weight="lm_head.up_proj.weight",   # [vocab, rank], not [vocab, hidden]: never read here
        feature_hook_mapping={"mlp.hook_in": ("model.layers[{layer}].post_attention_layernorm", "output"),
                              "mlp.hook_out": ("model.layers[{layer}].mlp", "output")},
    ))
    model = side_model(args)
    tokens = torch.tensor([json.loads(args.tokens)])
    (logits, activations), cpu, wall = timed(lambda: model.get_activations(tokens), args.rounds)
    torch.save({"logits": logits, "activations": activations, "cpu_s": cpu, "wall_s": wall}, args.out)


def side_by_side(model, prompt: str = PROMPT, d_transcoder: int = 128, *, rounds: int = 3, threads: int | None = None,
                 seed: int = 0, side_python: Path = SIDE_PYTHON) -> dict:
    """circuit-tracer's logits and transcoder activations on `model` (a HookedAlphaEr) against ours, and the
    time ratio of that forward (its get_activations over our run_with_cache and encode)."""
    if not Path(side_python).exists():
        raise FileNotFoundError(f"{side_python} not found: build the side environment with `bash .ci/ct-env.sh`")
    tokens = model.to_tokens(prompt)
    model.check_length(tokens.shape[1])
    transcoders = jumprelu_transcoders(model, d_transcoder, seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.save_pretrained(tmp / "alpha-er", format="transformers")
        transcoders.save(tmp / "transcoders")
        command = [str(side_python), __file__, "--side", "--model", str(tmp / "alpha-er"),
                   "--transcoders", str(tmp / "transcoders"), "--tokens", json.dumps(tokens[0].tolist()),
                   "--out", str(tmp / "theirs.pt"), "--rounds", str(rounds)]
        if threads:
            command += ["--threads", str(threads)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the side environment's packages only
        subprocess.run(command, check=True, env=env, cwd=tmp)
        theirs = torch.load(tmp / "theirs.pt")

    def ours():
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens)
            return logits, torch.stack([transcoders.encode(layer, cache[transcoders[layer].input_hook][0])
                                        for layer in range(model.cfg.n_layer)])

    (logits, activations), cpu, wall = timed(ours, rounds)
    later = slice(1, None)   # circuit-tracer zeroes position 0 (the BOS)
    active, their_active = activations[:, later] > 0, theirs["activations"][:, later] > 0
    return {
        "d_transcoder": d_transcoder, "tokens": tokens.shape[1],
        "logits_equal": torch.equal(logits, theirs["logits"]),
        "active_features_equal": torch.equal(active, their_active),
        "active_features": int(active.sum()),
        "max_abs_activation_diff": float((activations[:, later] - theirs["activations"][:, later]).abs().max()),
        "their_position_0_zero": bool((theirs["activations"][:, 0] == 0).all()),
        "our_position_0_active": int((activations[:, 0] > 0).sum()),
        "hooked_models": {"cpu_s": round(cpu, 4), "wall_s": round(wall, 4)},
        "circuit_tracer": {"cpu_s": round(theirs["cpu_s"], 4), "wall_s": round(theirs["wall_s"], 4)},
        # circuit-tracer's time over ours: above 1, ours is faster.
        "speed_up_cpu": round(theirs["cpu_s"] / cpu, 3), "speed_up_wall": round(theirs["wall_s"] / wall, 3),
        "edges": "not compared: circuit-tracer's linearisation cannot freeze alpha-er's LayerNorm scales and has no "
                 "[vocab, hidden] unembedding for its factored head (see this module's docstring)",
    }


def main() -> None:
    parser = side_parser(__doc__, "the AlphaErForCausalLM directory", "where to save what it computed")
    parser.set_defaults(prompt=PROMPT)  # this module's prompt: 16 tokens, alpha-er's block_size
    parser.add_argument("--d-transcoder", type=int, default=128, help="transcoder width (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls after a warm-up; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, both sides (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.side:
        return side(args)
    from hooked_models.families import load_model

    model = load_model("embedded", family="alpha_er")
    figures = side_by_side(model, args.prompt, args.d_transcoder, rounds=args.rounds, threads=args.threads,
                           seed=args.seed, side_python=args.side_python)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
