"""The shipped models load through the real loaders and still do the task they were trained on."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import ArceeForCausalLM, AutoTokenizer

from hooked_models import HookedAlphaEr, HookedArcee
from hooked_models.embedded import EMBEDDED_DIR, embedded_checkpoint
from hooked_models.embedded.task import build_tokenizer, logit_difference, make_ioi_prompts

# Measured when training (hooked_models/embedded/*/training.json, 2000 prompts): Arcee accuracy
# 1.0 and mean logit difference 13.9, alpha-er 1.0 and 10.8. The thresholds leave room; the
# test prompts are freshly drawn.
MIN_ACCURACY = 0.98
MIN_MEAN_LOGIT_DIFF = 8.0
HELD_OUT_SEED = 20261129  # the training batches use seeds 1_000_000 + step


@pytest.fixture(scope="module")
def arcee():
    return HookedArcee.from_pretrained("embedded")


@pytest.fixture(scope="module")
def prompts():
    return make_ioi_prompts(400, HELD_OUT_SEED)


def test_embedded_name_loads_the_shipped_directory(arcee):
    direct = HookedArcee.from_pretrained(EMBEDDED_DIR / "arcee")
    assert embedded_checkpoint("arcee") == EMBEDDED_DIR / "arcee"
    for (name, p), (_, q) in zip(arcee.named_parameters(), direct.named_parameters()):
        assert torch.equal(p, q), name
    assert not arcee.training
    assert arcee.cfg.num_kv_heads < arcee.cfg.num_heads and arcee.cfg.rope.rope_type == "yarn"
    with pytest.raises(FileNotFoundError, match="no embedded nonesuch checkpoint"):
        embedded_checkpoint("nonesuch")


def test_shipped_tokenizer_is_the_task_tokenizer(arcee, prompts):
    shipped = AutoTokenizer.from_pretrained(str(EMBEDDED_DIR / "arcee"), local_files_only=True)
    assert shipped.get_vocab() == build_tokenizer().get_vocab() == arcee.tokenizer.get_vocab()
    assert arcee.to_single_token(" Mary") == shipped.convert_tokens_to_ids(" Mary")
    text = prompts.clean_text[:5]
    assert torch.equal(arcee.to_tokens(text), prompts.clean_tokens[:5])
    assert arcee.to_string(prompts.clean_tokens[0, 1:]) == text[0]


def test_transformers_loads_the_same_model(arcee, prompts):
    hf = ArceeForCausalLM.from_pretrained(str(EMBEDDED_DIR / "arcee")).eval()
    with torch.no_grad():
        expected = hf(prompts.clean_tokens[:64]).logits
        torch.testing.assert_close(arcee(prompts.clean_tokens[:64]), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def alpha_er():
    return HookedAlphaEr.from_pretrained("embedded")


def test_alpha_er_ships_as_a_safetensors_file_with_its_config_in_the_header(alpha_er):
    file = EMBEDDED_DIR / "alpha_er" / "model.safetensors"
    assert embedded_checkpoint("alpha_er") == EMBEDDED_DIR / "alpha_er"
    assert not (file.parent / "config.json").exists()  # the header alone carries the config
    with safe_open(str(file), framework="pt") as f:
        header = f.metadata()
    assert json.loads(header["block_size"]) == alpha_er.cfg.block_size == 16
    assert json.loads(header["mlp_experts"]) == alpha_er.cfg.mlp_experts == 4
    direct = HookedAlphaEr.from_pretrained(file)
    for (name, p), (_, q) in zip(alpha_er.named_parameters(), direct.named_parameters()):
        assert torch.equal(p, q), name
    assert not alpha_er.training
    assert alpha_er.tokenizer.get_vocab() == build_tokenizer().get_vocab()


def test_the_reference_loads_the_same_alpha_er(alpha_er, prompts, reference_alpha_er_classes):
    file = EMBEDDED_DIR / "alpha_er" / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        fields = {k: json.loads(v) for k, v in f.metadata().items() if k not in ("format", "model_type")}
    reference = reference_alpha_er_classes["model"](reference_alpha_er_classes["config"](**fields))
    reference.load_state_dict(load_file(str(file)), strict=True)
    with torch.no_grad():
        expected = reference.eval()(prompts.clean_tokens[:64])
        torch.testing.assert_close(alpha_er(prompts.clean_tokens[:64]), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["arcee", "alpha_er"])
def test_does_ioi_on_held_out_prompts(family, prompts, request):
    model = request.getfixturevalue(family)
    with torch.no_grad():
        clean = logit_difference(model(prompts.clean_tokens), prompts)
        corrupted = logit_difference(model(prompts.corrupted_tokens), prompts)
    assert (clean > 0).float().mean() >= MIN_ACCURACY
    assert clean.mean() >= MIN_MEAN_LOGIT_DIFF
    # Moving the repeated name flips the answer: the model reads which name is repeated.
    assert (corrupted < 0).float().mean() >= MIN_ACCURACY
    assert corrupted.mean() <= -MIN_MEAN_LOGIT_DIFF
