"""What this package writes reads the same under transformers 4.5x as under 5.x.

transformers 4.57 (which circuit-tracer and other tools still pin) reads the rotary from `rope_scaling`
and a top-level `rope_theta`, and knows no `TokenizersBackend`; 5.x reads `rope_parameters`. A file in
5.x's layout alone loads in 4.57 with the default rotary, YaRN silently dropped (logits off by 14 on the
embedded Arcee), and its tokenizer does not load. Here 4.57 itself, in the side environment CI builds
(`.ci/tf4-env`, see `.ci/run`), reads the embedded checkpoints and fresh `save_pretrained` outputs
(tests/weight_conversion/transformers4_reader.py); its logits must equal this package's bit for bit
and its tokenizers give the same ids and text.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hooked_models import HookedAlphaEr, HookedArcee
from hooked_models.embedded import embedded_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TF4_PYTHON = Path(os.environ.get("HOOKED_MODELS_TF4_PYTHON", ROOT / ".ci" / "tf4-env" / "bin" / "python"))
READER = Path(__file__).with_name("transformers4_reader.py")


TEXTS = ["When Mary and John went to the store together, John gave a drink to",
         "Then, Zorblax and Bob had an argument at the park. Bob said to"]   # an unknown word: <unk> in both
# Tiny random Arcees whose rotary settings each matter: YaRN with an explicit factor that is not
# max_position_embeddings / original (256/16), explicit attention_factor and betas and another theta;
# YaRN with mscale / mscale_all_dim and untruncated correction range; the default rotary.
ROTARIES = {
    "yarn": {"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
             "beta_slow": 2.0, "attention_factor": 1.3, "rope_theta": 5000.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.5,
                    "mscale_all_dim": 0.5, "truncate": False, "rope_theta": 10000.0},
    "default": {"rope_type": "default", "rope_theta": 500.0},
}


@pytest.fixture(scope="module")
def read_by_transformers4(tmp_path_factory, hf_arcee_factory):
    """{case: (our model, token ids, what 4.57 made of its files)}, one 4.57 process for every case."""
    if not TF4_PYTHON.exists():
        pytest.skip(f"needs transformers 4.57 in {TF4_PYTHON} (python -m venv .ci/tf4-env && "
                    ".ci/tf4-env/bin/pip install torch==2.13.0 'transformers==4.57.*'; bash .ci/run builds it)")
    out = tmp_path_factory.mktemp("transformers4")
    embedded = HookedArcee.from_pretrained("embedded")
    alpha_er = HookedAlphaEr.from_pretrained("embedded")
    alpha_er.save_pretrained(out / "alpha_er_saved" / "model.safetensors")
    models = {"embedded_arcee": (embedded, embedded_checkpoint("arcee")),
              "embedded_alpha_er": (alpha_er, embedded_checkpoint("alpha_er")),
              "alpha_er_saved": (alpha_er, out / "alpha_er_saved")}
    for name, rope in ROTARIES.items():
        model = HookedArcee.from_hf(hf_arcee_factory(seed=3, rope_parameters=rope))
        model.save_pretrained(out / name)
        models[name] = (model, out / name)
    embedded.save_pretrained(out / "embedded_arcee_saved")   # the package's writer, with a tokenizer
    models["embedded_arcee_saved"] = (embedded, out / "embedded_arcee_saved")

    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))   # past 16 and 32 positions
    job = {}
    for name, (model, directory) in models.items():
        tokens = embedded.to_tokens(TEXTS[:1]) if name.startswith("embedded_arcee") else ids
        job[name] = {"dir": str(directory), "model": isinstance(model, HookedArcee), "ids": tokens.tolist(),
                     "texts": TEXTS if model.tokenizer is not None else []}
    (out / "job.json").write_text(json.dumps(job))
    subprocess.run([str(TF4_PYTHON), str(READER), str(out / "job.json"), str(out / "read.pt")], check=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": ""}, stdout=sys.stdout, stderr=sys.stderr)
    read = torch.load(out / "read.pt", weights_only=True)
    return {name: (model, torch.tensor(job[name]["ids"]), read[name]) for name, (model, _) in models.items()}


@pytest.mark.parametrize("case", ["embedded_arcee", "embedded_arcee_saved", *ROTARIES])
def test_transformers4_computes_our_logits_from_our_files(read_by_transformers4, case):
    model, ids, theirs = read_by_transformers4[case]
    assert theirs["transformers"].startswith("4.57"), theirs["transformers"]
    assert "read_model_error" not in theirs, theirs["read_model_error"]
    rope = model.cfg.rope
    assert theirs["rope_type"] == rope.rope_type
    assert theirs["attention_scaling"] == model.rotary_emb.attention_scaling
    assert torch.equal(theirs["inv_freq"], model.rotary_emb.inv_freq(torch.device("cpu")))
    with torch.no_grad():
        ours = model(ids)
    assert torch.equal(theirs["logits"], ours), (theirs["logits"] - ours).abs().max()


@pytest.mark.parametrize("case", ["embedded_arcee", "embedded_arcee_saved", "embedded_alpha_er", "alpha_er_saved"])
def test_transformers4_tokenizes_as_we_do(read_by_transformers4, case):
    model, _, theirs = read_by_transformers4[case]
    assert "read_tokenizer_error" not in theirs, theirs["read_tokenizer_error"]
    assert theirs["tokenizer_class"] == "PreTrainedTokenizerFast"
    ours = [model.tokenizer(text)["input_ids"] for text in TEXTS]
    assert theirs["token_ids"] == ours
    assert model.tokenizer.unk_token_id in ours[1]
    assert theirs["decoded"] == [model.tokenizer.decode(ids) for ids in ours]


def test_the_written_config_carries_both_rotary_layouts_and_they_agree():
    """5.x takes rope_scaling over rope_parameters when both are present, so they must be the same
    fields; the converter reads the file back to the same rotary (it refuses a disagreement)."""
    from weight_conversion.arcee import convert_arcee_config, hf_config_dict

    cfg = HookedArcee.from_pretrained("embedded").cfg
    written = hf_config_dict(cfg)
    assert written["rope_scaling"] == {k: v for k, v in written["rope_parameters"].items() if k != "rope_theta"}
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == cfg.rope.theta
    assert isinstance(written["rope_scaling"]["factor"], float)   # 4.57 warns about an integer factor
    assert convert_arcee_config(written).rope == cfg.rope
    assert json.loads((embedded_checkpoint("arcee") / "config.json").read_text()) == written
