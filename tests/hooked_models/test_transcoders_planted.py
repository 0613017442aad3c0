"""Transcoder bugs that the round trips and the formula tests of test_transcoders.py cannot see, each
with a fixture that tells the right code from the wrong one: JumpReLU at pre == threshold, and an
asymmetric W_skip (or encoder) written transposed on disk, which our own loader would read back
transposed again. The files are checked against circuit-tracer's arithmetic (`SingleLayerTranscoder`:
pre = x @ W_enc.T + b_enc from the file's [d_transcoder d_in] encoder, x @ W_skip.T for the skip,
`JumpReLU`: x * (x > threshold)), here from the tensors and, where the side environment .ci/ct-env exists,
by circuit-tracer's own loader."""

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hooked_models.transcoders import CrossLayerTranscoder, Transcoder, TranscoderSet

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".ci" / "ct-env" / "bin" / "python"
D, D_TRANSCODER = 12, 20


def on_the_threshold(layer_weights: torch.Tensor, biases: torch.Tensor, thresholds: torch.Tensor):
    """Zero the first four features' encoder columns so their pre-activation is their bias whatever the
    input, and set their thresholds to it: pre == threshold exactly, and JumpReLU must give 0 there."""
    with torch.no_grad():
        layer_weights[:, :4] = 0
        thresholds[:4] = biases[:4].abs() + 0.5
        biases[:4] = thresholds[:4]


def jumprelu_of_the_formula(pre: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return torch.where(pre > threshold, pre, torch.zeros_like(pre))


def test_jumprelu_is_zero_where_the_pre_activation_equals_the_threshold(random_transcoder_):
    """circuit-tracer's and SAELens's JumpReLU is pre · [pre > θ]: a feature whose pre-activation is
    exactly its threshold is off. Per-layer, in a set and cross-layer."""
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(1))
    tc = random_transcoder_(Transcoder(D, D_TRANSCODER, layer=1, activation="jumprelu"))
    on_the_threshold(tc.W_enc, tc.b_enc, tc.threshold)
    pre = x @ tc.W_enc.detach() + tc.b_enc.detach()
    assert torch.equal(pre[:, :4], tc.threshold.detach()[:4].expand(7, 4))  # the fixture: on the threshold
    expected = jumprelu_of_the_formula(pre, tc.threshold.detach())
    assert bool((expected[:, 4:] > 0).any()) and bool((expected[:, 4:] == 0).any())
    torch.testing.assert_close(tc.encode(x), expected, rtol=0, atol=1e-6)
    assert torch.equal(tc.encode(x)[:, :4], torch.zeros(7, 4))
    tcs = TranscoderSet([random_transcoder_(Transcoder(D, D_TRANSCODER, layer=0, activation="jumprelu")), tc])
    assert torch.equal(tcs.encode(1, x)[:, :4], torch.zeros(7, 4))

    clt = random_transcoder_(CrossLayerTranscoder(2, D, D_TRANSCODER, activation="jumprelu"))
    on_the_threshold(clt.W_enc[1], clt.b_enc[1], clt.threshold[1])
    assert torch.equal(clt.encode(1, x)[:, :4], torch.zeros(7, 4))
    assert bool((clt.encode(1, x)[:, 4:] > 0).any())


def asymmetric_set(random_transcoder_, activation: str = "jumprelu") -> TranscoderSet:
    """Two layers of skip transcoders whose every matrix is its own: W_skip far from symmetric (square, so
    its transpose has its shape), each encoder apart from its decoder, and, for JumpReLU, four features
    of layer 1 on their thresholds."""
    layers = [random_transcoder_(Transcoder(D, D_TRANSCODER, layer=l, activation=activation, skip=True), seed=l)
              for l in range(2)]
    if activation == "jumprelu":
        on_the_threshold(layers[1].W_enc, layers[1].b_enc, layers[1].threshold)
    for tc in layers:
        skip = tc.W_skip.detach()
        assert (skip - skip.T).abs().max() > 0.5 * skip.abs().max()
        assert not torch.allclose(tc.W_enc, tc.W_dec.T, atol=0.1)
    return TranscoderSet(layers)


def test_the_saved_files_compute_circuit_tracers_function(tmp_path, random_transcoder_):
    """Each layer's safetensors, read as circuit-tracer reads them (W_enc [d_transcoder d_in] applied as
    x @ W_enc.T, the skip as x @ W_skip.T, JumpReLU strict), is our transcoder's function: its skip alone and
    the whole forward. A W_skip written transposed (and read back transposed by our loader) fails here."""
    tcs = asymmetric_set(random_transcoder_)
    tcs.save(tmp_path)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(2))
    for layer, tc in enumerate(tcs):
        state = load_file(str(tmp_path / f"layer_{layer}.safetensors"))
        torch.testing.assert_close(tc.skip(x), x @ state["W_skip"].T, rtol=1e-5, atol=1e-6)
        pre = x @ state["W_enc"].T + state["b_enc"]
        acts = jumprelu_of_the_formula(pre, state["activation_function.threshold"])
        expected = acts @ state["W_dec"] + state["b_dec"] + x @ state["W_skip"].T
        torch.testing.assert_close(tc(x), expected, rtol=1e-5, atol=1e-6)


# The side half: circuit-tracer's own loader and its SingleLayerTranscoder (imports nothing of hooked_models).
SIDE_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch, yaml
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set
    directory = Path(sys.argv[1])
    config = yaml.safe_load((directory / "config.yaml").read_text())
    paths = {l: str(directory / name) for l, name in enumerate(config["transcoders"])}
    tcs = load_transcoder_set(paths, scan="planted", feature_input_hook="mlp.hook_in",
                              feature_output_hook="mlp.hook_out", device=torch.device("cpu"),
                              dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    x = torch.load(directory / "x.pt")
    out = {}
    for l in range(len(paths)):
        tc = tcs[l]
        out[l] = {"skip": tc.compute_skip(x), "acts": tc.encode(x), "forward": tc(x),
                  "activation": type(tc.activation_function).__name__}
    torch.save(out, directory / "theirs.pt")
""")


@pytest.mark.skipif(not SIDE_PYTHON.exists(), reason=f"no side environment at {SIDE_PYTHON} "
                    "(bash .ci/ct-env.sh builds it: circuit-tracer 0.5.0)")
@pytest.mark.parametrize("activation", ["jumprelu", "relu"])
def test_circuit_tracers_loader_reads_our_files_as_our_function(tmp_path, random_transcoder_, activation):
    """Our saved set, loaded by circuit-tracer's `load_transcoder_set` in its own environment: its
    `compute_skip`, `encode` and forward equal ours (float32 rounding), JumpReLU features on their
    thresholds off on both sides."""
    tcs = asymmetric_set(random_transcoder_, activation)
    tcs.save(tmp_path)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(SIDE_PYTHON), "-c", SIDE_SCRIPT, str(tmp_path)], check=True, env=env, cwd=tmp_path)
    theirs = torch.load(tmp_path / "theirs.pt")
    for layer, tc in enumerate(tcs):
        assert (theirs[layer]["activation"] == "JumpReLU") == (activation == "jumprelu")
        with torch.no_grad():
            torch.testing.assert_close(tc.skip(x), theirs[layer]["skip"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(tc.encode(x), theirs[layer]["acts"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(tc(x), theirs[layer]["forward"], rtol=1e-5, atol=1e-6)
    if activation == "jumprelu":
        assert torch.equal(theirs[1]["acts"][:, :4], torch.zeros(9, 4))
