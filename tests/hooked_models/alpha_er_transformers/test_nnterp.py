"""nnsight and nnterp on alpha-er, in the side environment .ci/nn-env (`bash .ci/nn-env.sh`; their pins never
share the main one): nnsight's LanguageModel traces it (reads and writes a layer's output), nnterp's
StandardizedTransformer loads it with ALPHA_ER_RENAME and passes its own checks, and every value they read
equals HookedAlphaEr's of the same standard name bit for bit (float32; the same operations in the same order)."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from hooked_models import HookedAlphaEr

ROOT = Path(__file__).resolve().parents[3]
NN_PYTHON = Path(os.environ.get("HOOKED_MODELS_NN_PYTHON", ROOT / ".ci" / "nn-env" / "bin" / "python"))
READER = Path(__file__).with_name("nnterp_reader.py")


@pytest.fixture(scope="module")
def read_by_nnterp(tmp_path_factory, tiny_factories):
    """(HookedAlphaEr, tokens, what nnsight and nnterp read from its transformers checkpoint)."""
    if not NN_PYTHON.exists():
        pytest.skip(f"needs nnsight and nnterp in {NN_PYTHON} (bash .ci/nn-env.sh builds it)")
    out = tmp_path_factory.mktemp("nnterp")
    # Random weights with a cap that bites (2), and the embedded tokenizer (nnsight loads one).
    _, make_reference_alpha_er = tiny_factories
    model = HookedAlphaEr.from_reference(make_reference_alpha_er(21, vocab_size=127, attn_soft_cap=2.0))
    model.tokenizer = HookedAlphaEr.from_pretrained("embedded").tokenizer
    model.save_pretrained(out / "alpha-er", format="transformers")
    tokens = torch.randint(0, 127, (2, model.cfg.block_size), generator=torch.Generator().manual_seed(22))
    torch.save(tokens, out / "tokens.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([str(NN_PYTHON), str(READER), str(out / "alpha-er"), str(out / "tokens.pt"),
                             str(out / "read.pt")], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return model, tokens, torch.load(out / "read.pt")


def test_nnsight_reads_and_writes_a_layer_output(read_by_nnterp):
    model, tokens, read = read_by_nnterp
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        doubled = model.run_with_hooks(tokens, fwd_hooks=[("layers.0.layer_output", lambda x, hook: x * 2)])
    assert torch.equal(read["nnsight.layers.0"], cache["layers.0.layer_output"])
    assert torch.equal(read["nnsight.doubled_logits"], doubled)
    assert not torch.equal(doubled, cache["logits"])


@pytest.mark.parametrize("theirs, ours", [
    ("layers_output", "layers.{i}.layer_output"),
    ("attentions_output", "layers.{i}.self_attn.attention_output"),
    ("mlps_output", "layers.{i}.mlp.mlp_output"),
    ("attention_probabilities", "layers.{i}.self_attn.attention_probabilities"),
])
def test_nnterp_standard_names_equal_ours(read_by_nnterp, theirs, ours):
    model, tokens, read = read_by_nnterp
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for i in range(model.cfg.n_layer):
        assert torch.equal(read[f"{theirs}.{i}"], cache[ours.format(i=i)]), (theirs, i)
    assert torch.equal(read["logits"], cache["logits"])


def test_nnterp_logit_lens_equals_ours(read_by_nnterp):
    """nnterp's lens, lm_head(ln_final(layers_output[i])), against our cache.logit_lens at every position
    (entry i + 1: the stream after layer i)."""
    model, tokens, read = read_by_nnterp
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        lens = cache.logit_lens(positions=None).values
    for i in range(model.cfg.n_layer):
        assert torch.equal(read[f"logit_lens.{i}"], lens[i + 1]), i


def test_the_guides_nnsight_and_nnterp_block_runs_there(tmp_path):
    """docs/guide/alpha-er-in-transformers.md's nnsight/nnterp block (which the README's block runner skips:
    nnsight is not in the main environment) runs in the side environment as written, on the checkpoint the
    block before it writes (the embedded alpha-er in transformers' format)."""
    if not NN_PYTHON.exists():
        pytest.skip(f"needs nnsight and nnterp in {NN_PYTHON} (bash .ci/nn-env.sh builds it)")
    import re

    page = (ROOT / "docs" / "guide" / "alpha-er-in-transformers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    write = next(b for b in blocks if 'save_pretrained("alpha-er-hf"' in b)
    trace = next(b for b in blocks if "load_standardized" in b)
    # the first block, in this environment, where the second will look for its checkpoint
    previous = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(write, "write", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(previous)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([str(NN_PYTHON), "-c", trace], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "(2, 16, 64) (2, 4, 16, 16) (2, 16, 64)"
