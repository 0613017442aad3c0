"""The side by side with sparsify (benchmarks/transcoder_training.py): its token stream, its conversion of
sparsify's saved transcoders against sparsify's arithmetic written here, and, where the side environment
.ci/sparsify-env exists (`bash .ci/sparsify-env.sh`; not built by CI), a short run of sparsify whose converted
transcoders our evaluation scores as sparsify's own forward does."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import transcoder_training as tt  # noqa: E402
from hooked_models.families import load_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return load_model("embedded", family="arcee")


def sparsify_forward(state: dict, x: torch.Tensor, k: int) -> torch.Tensor:
    """sparsify 1.3.3's SparseCoder.forward for a transcoder without a skip connection (fused_encoder: top-k of
    relu(x W^T + b); decode: the chosen rows of W_dec weighted by their activations, plus b_dec)."""
    pre = torch.relu(x @ state["encoder.weight"].T + state["encoder.bias"])
    values, indices = pre.topk(k, dim=-1)
    return (values[..., None] * state["W_dec"][indices]).sum(-2) + state["b_dec"]


def write_sparsify(directory: Path, d_in: int, latents: int, k: int, seed: int, **config) -> list[dict]:
    """Random sparsify-layout transcoders of every hookpoint (untied, biases non-zero), as its save_to_disk writes."""
    generator = torch.Generator().manual_seed(seed)
    states = []
    for hookpoint in tt.HOOKPOINTS:
        state = {"encoder.weight": torch.randn(latents, d_in, generator=generator) / d_in ** 0.5,
                 "encoder.bias": 0.3 * torch.randn(latents, generator=generator),
                 "W_dec": torch.randn(latents, d_in, generator=generator) / latents ** 0.5,
                 "b_dec": 0.2 * torch.randn(d_in, generator=generator)}
        (directory / hookpoint).mkdir(parents=True)
        save_file(state, str(directory / hookpoint / "sae.safetensors"))
        (directory / hookpoint / "cfg.json").write_text(json.dumps(
            {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True, "num_latents": latents, "k": k,
             "multi_topk": False, "skip_connection": False, "transcode": True, "d_in": d_in, **config}))
        states.append(state)
    return states


def test_converted_transcoders_compute_what_sparsify_computes(model, tmp_path):
    states = write_sparsify(tmp_path, model.cfg.hidden_size, 96, k=8, seed=0)
    transcoders = tt.from_sparsify(tmp_path, model)
    x = torch.randn(40, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer, state in enumerate(states):
        ours = transcoders[layer](x)
        torch.testing.assert_close(ours, sparsify_forward(state, x, k=8), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(ours, sparsify_forward(states[1 - layer], x, k=8))  # the layers are not swapped


def test_conversion_refuses_a_coder_it_does_not_convert(model, tmp_path):
    write_sparsify(tmp_path, model.cfg.hidden_size, 96, k=8, seed=0, skip_connection=True)
    with pytest.raises(ValueError, match="skip connection True"):
        tt.from_sparsify(tmp_path, model)


def test_the_stream_is_one_permutation_of_the_corpus_after_another():
    corpus = torch.arange(10 * 3).reshape(10, 3)
    stream = tt.training_stream(corpus, 25, seed=4)
    assert stream.shape == (25, 3) and torch.equal(stream, tt.training_stream(corpus, 25, seed=4))
    for start in (0, 10):
        assert sorted(stream[start:start + 10, 0].tolist()) == corpus[:, 0].tolist()
    assert not torch.equal(stream[:10], stream[10:20]) and not torch.equal(stream[:10], corpus)
    assert set(stream[20:, 0].tolist()) <= set(corpus[:, 0].tolist())


@pytest.mark.skipif(not tt.SIDE_PYTHON.exists(), reason=f"no side environment at {tt.SIDE_PYTHON} "
                    "(bash .ci/sparsify-env.sh builds it: sparsify 1.3.3)")
def test_a_short_sparsify_run_scores_as_sparsify_scores_it(model, tmp_path):
    from hooked_models.embedded.task import make_ioi_prompts

    prompts = make_ioi_prompts(256, 5)
    stream = tt.training_stream(torch.cat([prompts.clean_tokens, prompts.corrupted_tokens]), 20 * tt.BATCH_PROMPTS)
    held_out = make_ioi_prompts(64, 8).clean_tokens
    save_file({"stream": stream, "held_out": held_out}, str(tmp_path / "tokens.safetensors"))
    args = argparse.Namespace(side_python=tt.SIDE_PYTHON, threads=1, model=model, held_out=held_out,
                              train_tokens=stream.numel(), done={})
    run = tt.run_side(args, "sparsify", tmp_path / "tokens.safetensors", 0, 16, *tt.adam(1.6e-2))
    assert run["fvu_conversion_rel_diff"] < 1e-5, run
    assert all(0 < fvu < 1 for fvu in run["fvu"]) and run["l0"][0] <= 16
    assert args.sparsify_versions["eai-sparsify"] == "1.3.3"
