"""Run in .ci/nn-env (nnsight 0.6.3, nnterp 1.3.0; hooked_models on PYTHONPATH, not installed): nnsight and
nnterp read an alpha-er transformers checkpoint; what they read is saved for the test to compare.

    python nnterp_reader.py CHECKPOINT TOKENS.pt OUT.pt
"""

import sys

import torch
from nnsight import LanguageModel

import hooked_models.alpha_er_transformers  # noqa: F401  (registers AlphaErForCausalLM with the Auto classes)
from hooked_models.alpha_er_transformers.nnterp_config import load_standardized

path, tokens_file, out_file = sys.argv[1:]
tokens = torch.load(tokens_file)
out = {}

# nnsight: read a layer's output, then write it (doubled) and read the logits that follow.
language_model = LanguageModel(path, device_map="cpu", dispatch=True)
with language_model.trace(tokens):
    out["nnsight.layers.0"] = language_model.model.layers[0].output.save()
with language_model.trace(tokens):
    language_model.model.layers[0].output = language_model.model.layers[0].output * 2
    out["nnsight.doubled_logits"] = language_model.output.logits.save()

# nnterp: loading runs its renaming, IO and attention-probability checks (at the architecture's length).
model = load_standardized(path, enable_attention_probs=True)
with model.trace(tokens):
    for i in range(model.num_layers):   # nnsight 0.6 reads values in the order the forward makes them
        out[f"attention_probabilities.{i}"] = model.attention_probabilities[i].save()
        out[f"attentions_output.{i}"] = model.attentions_output[i].save()
        out[f"mlps_output.{i}"] = model.mlps_output[i].save()
        out[f"layers_output.{i}"] = model.layers_output[i].save()
    out["logits"] = model.logits.save()
with model.trace(tokens):
    for i in range(model.num_layers):
        out[f"logit_lens.{i}"] = model.project_on_vocab(model.layers_output[i]).save()
torch.save({name: value.detach().clone() for name, value in out.items()}, out_file)
