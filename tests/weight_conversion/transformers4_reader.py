"""Read checkpoints with another transformers (4.5x) and report what it computes.

    .ci/tf4-env/bin/python tests/weight_conversion/transformers4_reader.py JOB.json OUT.pt

Run by tests/weight_conversion/test_transformers4.py in the side environment CI builds (transformers
4.57, no hooked_models): JOB.json lists checkpoint directories, each with token ids to run and texts to
tokenize; OUT.pt holds, per directory, the logits of `ArceeForCausalLM.from_pretrained` (where the
directory has a config.json), its rotary settings as 4.x read them, and `AutoTokenizer`'s ids and
decoded text, or the error that stopped each. Nothing here imports the package: the point is what transformers 4.x makes of its files.
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer


def read(entry: dict) -> dict:
    out = {"transformers": transformers.__version__}
    for part in (read_model, read_tokenizer):
        try:
            part(entry, out)
        except Exception as error:  # reported, for the test to show: what 4.x cannot read
            out[f"{part.__name__}_error"] = f"{type(error).__name__}: {error}"
    return out


def read_model(entry: dict, out: dict) -> None:
    if entry.get("model"):
        from transformers import ArceeForCausalLM

        model = ArceeForCausalLM.from_pretrained(entry["dir"], attn_implementation=entry.get("attention", "sdpa"))
        rotary = model.model.rotary_emb
        out["rope_type"], out["attention_scaling"] = rotary.rope_type, float(rotary.attention_scaling)
        out["inv_freq"] = rotary.inv_freq.clone()
        with torch.no_grad():
            out["logits"] = model(torch.tensor(entry["ids"])).logits


def read_tokenizer(entry: dict, out: dict) -> None:
    if not entry["texts"]:
        return
    tokenizer = AutoTokenizer.from_pretrained(entry["dir"])
    out["tokenizer_class"] = type(tokenizer).__name__
    out["token_ids"] = [tokenizer(text)["input_ids"] for text in entry["texts"]]
    out["decoded"] = [tokenizer.decode(ids) for ids in out["token_ids"]]


if __name__ == "__main__":
    job, target = sys.argv[1:]
    torch.save({name: read(entry) for name, entry in json.loads(Path(job).read_text()).items()}, target)
