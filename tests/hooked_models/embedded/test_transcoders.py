"""The transcoders shipped with the embedded models: small, loadable for their model only, and as
faithful as docs/guide/transcoders.md states, measured here again on the held-out prompts their training.json names."""

import json

import pytest
import torch

from hooked_models.embedded import EMBEDDED_DIR
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.embedded.train_transcoders import HELD_OUT_PROMPTS, HELD_OUT_SEED
from hooked_models.families import load_model
from hooked_models.transcoders import TranscoderSet, load_transcoders, transcoder_fidelity

# The bounds docs/guide/transcoders.md states: each layer's MLP-output variance explained, and the
# next-token loss recovered with every MLP replaced (no error terms), on 512 held-out IOI prompts.
BOUNDS = {"arcee": (0.99, 0.99), "alpha_er": (0.95, 0.98)}


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_shipped_transcoders_meet_their_stated_fidelity(family):
    model = load_model("embedded", family)
    transcoders = load_transcoders("embedded", model=model)
    assert isinstance(transcoders, TranscoderSet) and transcoders.n_layers == model.cfg.num_layers
    directory = EMBEDDED_DIR / family / "transcoders"
    assert sum(p.stat().st_size for p in directory.iterdir()) < 300_000  # a few hundred KB
    tokens = make_ioi_prompts(HELD_OUT_PROMPTS, HELD_OUT_SEED).clean_tokens
    fidelity = transcoder_fidelity(model, transcoders, tokens)
    explained, recovered = BOUNDS[family]
    assert min(fidelity["variance_explained"]) >= explained, fidelity
    assert fidelity["loss_recovered"] >= recovered, fidelity
    # training.json states what this measures.
    stated = json.loads((directory / "training.json").read_text())
    for key in ("variance_explained", "loss", "loss_spliced", "loss_recovered"):
        torch.testing.assert_close(torch.tensor(fidelity[key]), torch.tensor(stated[key]), rtol=1e-5, atol=1e-6)
    # With error terms the replacement model is the model, bit for bit.
    with torch.no_grad():
        assert torch.equal(model.run_with_saes(tokens[:32], saes=transcoders, use_error_term=True), model(tokens[:32]))


def test_shipped_transcoders_refuse_the_other_model():
    with pytest.raises(ValueError, match="trained for the arcee model .* this model has family='alpha_er'"):
        TranscoderSet.load(EMBEDDED_DIR / "arcee" / "transcoders", model=load_model("embedded", "alpha_er"))
