"""circuit-tracer on alpha-er (benchmarks/circuit_tracer_alpha_er.py), where the side environment .ci/ct-env exists
(`bash .ci/ct-env.sh`): its nnsight backend loads AlphaErForCausalLM from the checkpoint's own source files, and its
logits and our transcoders' activations (read at the MLP input through its alpha-er mapping) equal ours bit for bit,
at every position but 0, which circuit-tracer zeroes. Edges are not compared: its linearisation cannot express
alpha-er (the benchmark's docstring says what)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import circuit_tracer_alpha_er as ct_alpha_er  # noqa: E402
from hooked_models.families import load_model  # noqa: E402


@pytest.mark.skipif(not ct_alpha_er.SIDE_PYTHON.exists(), reason=f"no side environment at {ct_alpha_er.SIDE_PYTHON} "
                    "(bash .ci/ct-env.sh builds it: circuit-tracer 0.5.0, transformers 4.57)")
def test_circuit_tracer_computes_alpha_er_forward_as_we_do():
    model = load_model("embedded", family="alpha_er")
    figures = ct_alpha_er.side_by_side(model, ct_alpha_er.PROMPT, 128, rounds=1)
    assert figures["tokens"] == model.cfg.block_size
    assert figures["logits_equal"] and figures["active_features_equal"], figures
    assert figures["max_abs_activation_diff"] == 0 and figures["active_features"] > 100, figures
    assert figures["their_position_0_zero"] and figures["our_position_0_active"] > 0, figures
