import pytest
import torch
from transformers import AutoTokenizer

from hooked_models.embedded.task import (
    BOS, NAMES, PROMPT_LENGTH, TEMPLATES, build_tokenizer, logit_difference, make_ioi_prompts, vocabulary,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_tokenizer_round_trips_through_save_pretrained(tokenizer, tmp_path):
    tokenizer.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.get_vocab() == tokenizer.get_vocab() == {w: i for i, w in enumerate(vocabulary())}
    assert (loaded.bos_token, loaded.bos_token_id, loaded.pad_token_id) == (BOS, 1, 0)
    text = "When Mary and John went to the store together, John gave a drink to"
    ids = loaded(text)["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == PROMPT_LENGTH
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert loaded.convert_ids_to_tokens(ids[1:3]) == ["When", " Mary"]
    assert loaded("When Zork went")["input_ids"][2] == loaded.unk_token_id


def test_prompts_are_seeded_and_tokenize_like_their_text(tokenizer):
    prompts = make_ioi_prompts(40, seed=3, tokenizer=tokenizer)
    again = make_ioi_prompts(40, seed=3, tokenizer=tokenizer)
    other = make_ioi_prompts(40, seed=4, tokenizer=tokenizer)
    assert torch.equal(prompts.clean_tokens, again.clean_tokens)
    assert not torch.equal(prompts.clean_tokens, other.clean_tokens)
    assert prompts.clean_tokens.shape == prompts.corrupted_tokens.shape == (40, PROMPT_LENGTH)
    assert set(prompts.template.tolist()) == set(range(len(TEMPLATES)))
    assert set(prompts.io_first.tolist()) == {True, False}
    for tokens, text in zip(prompts.clean_tokens.tolist() + prompts.corrupted_tokens.tolist(),
                            prompts.clean_text + prompts.corrupted_text):
        assert tokenizer(text)["input_ids"] == tokens


def test_corruption_moves_the_repeated_name(tokenizer):
    prompts = make_ioi_prompts(60, seed=0, tokenizer=tokenizer)
    rows = torch.arange(len(prompts))
    clean, corrupted, pos = prompts.clean_tokens, prompts.corrupted_tokens, prompts.positions
    # Only the second mention of the subject differs, and it becomes the indirect object.
    assert torch.equal((clean != corrupted).sum(-1), torch.ones(len(prompts), dtype=torch.long))
    assert torch.equal(clean[rows, pos["s2"]], prompts.incorrect)
    assert torch.equal(corrupted[rows, pos["s2"]], prompts.correct)
    # The clean answer is said once and the subject twice; the corruption swaps the counts.
    count = lambda tokens, ids: (tokens == ids[:, None]).sum(-1)  # noqa: E731
    assert (count(clean, prompts.correct) == 1).all() and (count(clean, prompts.incorrect) == 2).all()
    assert (count(corrupted, prompts.correct) == 2).all() and (count(corrupted, prompts.incorrect) == 1).all()
    io_pos = torch.where(prompts.io_first, pos["a"], pos["b"])
    assert torch.equal(clean[rows, io_pos], prompts.correct)
    assert (pos["a"] < pos["b"]).all() and (pos["b"] < pos["s2"]).all() and (pos["s2"] < pos["end"]).all()
    names = {tokenizer.convert_tokens_to_ids(" " + n) for n in NAMES}
    assert set(prompts.correct.tolist()) <= names and (prompts.correct != prompts.incorrect).all()


def test_template_choice_and_bad_arguments(tokenizer):
    prompts = make_ioi_prompts(10, seed=0, tokenizer=tokenizer, templates=(2,))
    assert (prompts.template == 2).all()
    assert all(text.startswith("Then,") for text in prompts.clean_text)
    with pytest.raises(ValueError, match="at least one"):
        make_ioi_prompts(0, seed=0, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="indices into the 6 TEMPLATES"):
        make_ioi_prompts(3, seed=0, tokenizer=tokenizer, templates=(9,))


def test_logit_difference_reads_the_two_answers(tokenizer):
    prompts = make_ioi_prompts(3, seed=0, tokenizer=tokenizer)
    logits = torch.zeros(3, PROMPT_LENGTH, len(tokenizer))
    logits[torch.arange(3), -1, prompts.correct] = torch.tensor([2.0, 0.0, -1.0])
    logits[torch.arange(3), -1, prompts.incorrect] = 0.5
    torch.testing.assert_close(logit_difference(logits, prompts), torch.tensor([1.5, -0.5, -1.5]))
