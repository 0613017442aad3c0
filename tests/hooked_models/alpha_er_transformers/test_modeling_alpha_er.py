"""AlphaErForCausalLM (transformers) against the transcribed alpha-er reference and HookedAlphaEr, on random
weights: logits bit for bit in float32, generate token for token, the capped attention pattern, the loss,
the refused attention implementations and inputs, and the remote code loaded where hooked_models is not."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM

from hooked_models import HookedAlphaEr
from hooked_models.alpha_er_transformers import AlphaErConfig, AlphaErForCausalLM
from hooked_models.alpha_er_transformers.modeling_alpha_er import eager_attention_forward
from weight_conversion.alpha_er_transformers import reference_to_transformers_state_dict, transformers_config

ROOT = Path(__file__).resolve().parents[3]
TF4_PYTHON = Path(os.environ.get("HOOKED_MODELS_TF4_PYTHON", ROOT / ".ci" / "tf4-env" / "bin" / "python"))

# Beside conftest's TINY_ALPHA_ER (cap 30): a cap of 2 that bites on most scores, 8 experts of width 4, 3
# layers; and the cap off, one expert, a head rank wider than the stream. The default size is its own test.
CONFIGS = [{}, dict(attn_soft_cap=2.0, mlp_experts=8, ffn_dim=32, n_layer=3, block_size=64),
           dict(attn_soft_cap=0.0, mlp_experts=1, attn_rank=40, lm_head_rank=3, n_head=2)]


def as_transformers(reference) -> AlphaErForCausalLM:
    """The reference's weights in an AlphaErForCausalLM, by the converters (names only: the tensors as they are)."""
    model = AlphaErForCausalLM(transformers_config(dict(vars(reference.cfg))))
    model.load_state_dict(reference_to_transformers_state_dict(reference.state_dict()), strict=True)
    return model.eval()


def tokens_for(cfg, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def trio(reference_alpha_er_factory):
    """(reference, AlphaErForCausalLM, HookedAlphaEr) on conftest's tiny config, or on overrides."""
    def make(seed: int = 0, **overrides):
        reference = reference_alpha_er_factory(seed, **overrides)
        return reference, as_transformers(reference), HookedAlphaEr.from_reference(reference)
    return make


@pytest.mark.parametrize("overrides", CONFIGS)
def test_logits_equal_the_reference_and_hooked_bit_for_bit(trio, overrides):
    reference, model, hooked = trio(seed=len(overrides), **overrides)
    tokens = tokens_for(reference.cfg, 3, reference.cfg.block_size, seed=2)
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
        expected = reference(tokens)
        _, cache = hooked.run_with_cache(tokens)
    assert torch.equal(out.logits, expected)
    assert torch.equal(out.logits, cache["logits"])
    # Layer by layer, where a divergence would start: the input of each layer, then the final norm's output.
    for i in range(reference.cfg.n_layer):
        assert torch.equal(out.hidden_states[i], cache[f"layers.{i}.layer_input"])
    assert torch.equal(out.hidden_states[-1], cache["final_norm_output"])


def test_the_default_size_equals_the_reference_bit_for_bit(full_size_alpha_er):
    reference, hooked = full_size_alpha_er
    model = hooked.to_hf()  # the same tensors, under the transformers names
    assert (model.config.hidden_size, model.config.intermediate_size, model.config.mlp_experts,
            model.config.vocab_size, model.config.max_position_embeddings) == (1024, 20480, 64, 12288, 512)
    tokens = tokens_for(reference.cfg, 1, 128)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens))


def reference_patterns(reference, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention probabilities, written out from the reference's weights in its own order:
    scores·1/sqrt(d), the tanh cap, -inf above the diagonal, softmax."""
    cfg = reference.cfg
    batch, seq = tokens.shape
    heads, head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
    x = reference.wte(tokens) + reference.wpe(torch.arange(seq))
    patterns = []
    for block in reference.blocks:
        q, k, _ = block.qkv(block.ln1(x)).split(cfg.n_embd, dim=-1)
        q, k = (t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in (q, k))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        if cfg.attn_soft_cap:
            scores = torch.tanh(scores / cfg.attn_soft_cap) * cfg.attn_soft_cap
        scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
        patterns.append(torch.softmax(scores, dim=-1))
        x = block(x)
    return patterns


def test_output_attentions_is_the_reference_capped_pattern(trio):
    reference, model, _ = trio(seed=4, **CONFIGS[1])
    tokens = tokens_for(reference.cfg, 2, reference.cfg.block_size, seed=5)
    with torch.no_grad():
        attentions = model(tokens, output_attentions=True).attentions
        expected = reference_patterns(reference, tokens)
        uncapped = AlphaErForCausalLM(model.config.__class__(**{**model.config.to_diff_dict(), "attn_soft_cap": 0}))
        uncapped.load_state_dict(model.state_dict())
        plain = uncapped.eval()(tokens, output_attentions=True).attentions
    assert len(attentions) == reference.cfg.n_layer
    for layer, (pattern, want) in enumerate(zip(attentions, expected)):
        assert torch.equal(pattern, want), layer
    assert (plain[0] - expected[0]).abs().max() > 0.05   # the cap bites in this fixture


@pytest.mark.parametrize("prompt_length, settings", [
    (5, {}),                                             # greedy; the window slides past block_size
    (30, dict(do_sample=True, temperature=0.8, top_k=5)),   # sampled as the reference samples
])
def test_generate_equals_the_reference_and_hooked(trio, prompt_length, settings):
    reference, model, hooked = trio(seed=6)
    prompt = tokens_for(reference.cfg, 1, prompt_length, seed=prompt_length)
    reference_settings = dict(temperature=settings.get("temperature", 0.0), top_k=settings.get("top_k", 40))
    runs = []
    for generate in (lambda: reference.generate(prompt, max_new_tokens=36, **reference_settings),
                     lambda: hooked.generate(prompt, max_new_tokens=36, **reference_settings),
                     lambda: model.generate(prompt, max_new_tokens=36, **settings)):
        torch.manual_seed(7)
        runs.append(generate().tolist())
    assert runs[2] == runs[0] == runs[1]
    assert len(runs[2][0]) == prompt_length + 36


def test_loss_is_the_shifted_cross_entropy(trio):
    reference, model, _ = trio(seed=8)
    tokens = tokens_for(reference.cfg, 2, reference.cfg.block_size, seed=9)
    labels = tokens.clone()
    labels[:, 20:] = -100   # right padding, ignored
    out = model(tokens, labels=labels)
    expected = F.cross_entropy(reference(tokens)[:, :-1].reshape(-1, reference.cfg.vocab_size),
                               labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)   # one mean, summed in another order
    out.loss.backward()
    assert model.model.layers[0].mlp.up_proj.grad.abs().sum() > 0


def test_right_padding_leaves_the_real_positions_as_unpadded(trio):
    reference, model, _ = trio(seed=10)
    tokens = tokens_for(reference.cfg, 2, reference.cfg.block_size, seed=11)
    mask = torch.ones_like(tokens)
    mask[1, 20:] = 0
    with torch.no_grad():
        assert torch.equal(model(tokens, attention_mask=mask).logits[1, :20], reference(tokens)[1, :20])
        with pytest.raises(ValueError, match="padding must be on the right"):
            model(tokens, attention_mask=mask.flip(-1))


def test_a_row_of_padding_alone_attends_each_position_to_itself(trio):
    """A batch row whose attention_mask is all zeros (no real key for any query): each query keeps itself,
    so its pattern is the identity in every layer and head and its logits are finite; the other row is
    its unpadded self bit for bit."""
    reference, model, _ = trio(seed=13)
    tokens = tokens_for(reference.cfg, 2, reference.cfg.block_size, seed=14)
    mask = torch.ones_like(tokens)
    mask[1] = 0
    with torch.no_grad():
        out = model(tokens, attention_mask=mask, output_attentions=True)
        expected = reference(tokens)
    assert torch.equal(out.logits[0], expected[0])
    assert torch.isfinite(out.logits[1]).all()
    eye = torch.eye(tokens.shape[1]).expand(reference.cfg.n_head, -1, -1)
    for layer, pattern in enumerate(out.attentions):
        assert torch.equal(pattern[1], eye), layer


# --------------------------------------------------------------------------- attention implementations
@pytest.fixture
def saved(trio, tmp_path):
    reference, model, _ = trio(seed=12, attn_soft_cap=2.0)
    model.save_pretrained(tmp_path / "alpha-er")
    return reference, model, tmp_path / "alpha-er"


@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2", "flex_attention"])
def test_an_implementation_that_cannot_cap_is_refused(saved, implementation):
    _, model, path = saved
    with pytest.raises(ValueError, match=rf"attn_implementation='{implementation}'.*attn_implementation='eager'"):
        AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation)
    model.config._attn_implementation = implementation   # set past the loader's check: refused at the forward
    with pytest.raises(ValueError, match="soft-caps the scores.*'eager'"):
        model(torch.zeros(1, 32, dtype=torch.long))


def test_a_registered_function_is_passed_the_cap(saved):
    reference, _, path = saved
    seen = []

    def recorded(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs["softcap"])
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("alpha_er_test_recorded", recorded)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="alpha_er_test_recorded").eval()
    tokens = tokens_for(reference.cfg, 1, 32)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens))
    assert seen == [2.0, 2.0]


# --------------------------------------------------------------------------------------- bad input
def test_a_length_off_the_rule_is_refused(trio):
    _, model, _ = trio()
    with pytest.raises(ValueError, match="sequence length 30 is not a multiple of mlp_experts=4"):
        model(torch.zeros(1, 30, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length 36 is longer than max_position_embeddings=32"):
        model(torch.zeros(1, 36, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids must be 0..31"):
        model(torch.zeros(1, 32, dtype=torch.long), position_ids=torch.arange(1, 33)[None])
    with pytest.raises(ValueError, match="no key/value cache"):
        model(torch.zeros(1, 32, dtype=torch.long), use_cache=True)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_theta=10000.0), r"does not know the field\(s\) \['rope_theta'\]"),
    (dict(n_embd=32), r"\['n_embd'\] \(n_embd is called hidden_size here\)"),
    (dict(intermediate_size=50, mlp_experts=4), "intermediate_size=50 is not divisible by mlp_experts=4"),
    (dict(model_type="arcee"), "model_type='arcee': this is not an alpha-er config"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=8"),
    (dict(head_dim=64), "head_dim=64 must be hidden_size/num_attention_heads=128"),
])
def test_a_config_it_does_not_know_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        AlphaErConfig(**fields)


def test_a_checkpoint_of_the_other_family_is_refused(tiny_hf_arcee, tmp_path):
    tiny_hf_arcee.save_pretrained(tmp_path / "arcee")
    with pytest.raises(ValueError, match="model_type='arcee': this is not an alpha-er config"):
        AlphaErForCausalLM.from_pretrained(tmp_path / "arcee")


def test_generate_refuses_what_it_cannot_do(trio):
    _, model, _ = trio()
    prompt = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(TypeError, match=r"not \['num_beams'\]"):
        model.generate(prompt, num_beams=2)
    with pytest.raises(ValueError, match="rows of equal length"):
        model.generate(prompt, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))


# -------------------------------------------------------------------------------------- remote code
# A fresh process in which hooked_models and weight_conversion cannot be imported: only transformers reads
# the directory, through the auto_map and the two source files save_pretrained wrote beside the weights.
READ_REMOTE = """
import sys, json, torch
sys.modules["hooked_models"] = sys.modules["weight_conversion"] = None   # importing them now fails
from transformers import AutoModelForCausalLM
path, tokens = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    torch.save(model(tokens).logits, sys.argv[3])
"""


@pytest.mark.parametrize("python", [sys.executable, TF4_PYTHON], ids=["transformers5", "transformers4.57"])
def test_remote_code_loads_with_transformers_alone(saved, tmp_path, python):
    if not Path(python).exists():
        pytest.skip(f"needs transformers 4.57 in {python} (bash .ci/run builds .ci/tf4-env)")
    reference, _, path = saved
    assert json.loads((path / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "configuration_alpha_er.AlphaErConfig",
        "AutoModelForCausalLM": "modeling_alpha_er.AlphaErForCausalLM"}
    alone = shutil.copytree(path, tmp_path / "elsewhere")
    tokens = tokens_for(reference.cfg, 2, 32, seed=13)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")   # a fresh cache of remote code, not a shared one
    result = subprocess.run([str(python), "-c", READ_REMOTE, str(alone), json.dumps(tokens.tolist()),
                             str(tmp_path / "logits.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), reference(tokens))
