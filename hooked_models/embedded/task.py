"""The embedded models' task: indirect-object identification (IOI) over a word-level vocabulary.

"When Mary and John went to the store together, John gave a drink to" -> " Mary". The answer is
the name said once; the subject is said twice. Every template is 15 words after BOS, so every
prompt is 16 tokens: prompts stack without padding, and the corrupted prompt of a pair (the
second mention of the subject replaced by the indirect object, which flips the answer) has the
same length and positions as the clean one. This is the task of Wang et al. 2022, "Interpretability
in the Wild" (arXiv:2211.00593), shrunk to procedurally generated sentences.
"""

import re
from dataclasses import dataclass, field

import torch
from jaxtyping import Bool, Int
from torch import Tensor

BOS, EOS, PAD, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3

NAMES = (
    "Mary", "John", "Alice", "Bob", "Sarah", "James", "Emma", "David", "Laura", "Michael", "Anna", "Daniel",
    "Kate", "Paul", "Lucy", "Mark", "Rose", "Peter", "Grace", "Tom", "Helen", "Chris", "Julia", "Sam",
    "Clara", "Henry", "Olivia", "Jack", "Sophie", "Adam", "Ruth", "Oscar", "Nora", "Victor", "Ella", "Leo",
    "Maya", "Ivan", "Zoe", "Frank", "Irene", "George", "Amy", "Hugo", "Lily", "Carl", "Eva", "Max",
)
PLACES = (
    "store", "park", "school", "garden", "station", "market", "beach", "library", "office", "museum",
    "hospital", "restaurant", "church", "farm", "bank", "cafe", "zoo", "river", "lake", "house",
)
OBJECTS = (
    "drink", "book", "ball", "cake", "bag", "box", "pen", "hat", "cup", "key",
    "letter", "flower", "ring", "bottle", "basket", "gift", "toy", "coin", "map", "phone",
)
# {io}/{s}: the two names in either order as {a} and {b}; {c}: the second mention of the subject.
TEMPLATES = (
    "When {a} and {b} went to the {place} together, {c} gave a {object} to",
    "After {a} and {b} spent time at the {place}, {c} handed the {object} to",
    "Then, {a} and {b} had an argument at the {place}. {c} said to",
    "While {a} and {b} were working at the {place}, {c} passed the {object} to",
    "Later {a} and {b} found a {object} at the {place}. {c} gave it to",
    "The {place} was very quiet when {a} and {b} arrived, so {c} waved to",
)
PROMPT_LENGTH = 16  # BOS + 15 words, for every template
# Words as the pre-tokenizer cuts them: a word with its leading space, or one punctuation mark.
WORD_PATTERN = r" ?[A-Za-z]+| ?[^A-Za-z\s]"


def vocabulary() -> list[str]:
    """Every token, in id order: the specials, the templates' words, then names, places, objects."""
    words: list[str] = list(SPECIAL_TOKENS)
    fillers = {"a": "X", "b": "X", "c": "X", "place": "X", "object": "X"}
    for template in TEMPLATES:
        for word in re.findall(WORD_PATTERN, template.format(**fillers)):
            if word not in words and word.strip() != "X":
                words.append(word)
    for word in (*NAMES, *PLACES, *OBJECTS):
        if " " + word not in words:
            words.append(" " + word)
    return words


def build_tokenizer():
    """The word-level tokenizer, as a transformers `PreTrainedTokenizerFast` (save_pretrained writes
    tokenizer.json, which `AutoTokenizer.from_pretrained` reads back offline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Words keep their leading space (" Mary", as in BPE vocabularies), so decoding is concatenation.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="isolated")
    core.decoder = decoders.Fuse()
    # BOS first when special tokens are asked for, as Llama-family tokenizers do.
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=PROMPT_LENGTH * 4,
    )


@dataclass
class IOIPrompts:
    """Matched clean and corrupted prompts, [batch seq] each, and the two candidate answers.

    `correct` is the indirect object (the clean answer), `incorrect` the subject; in the corrupted
    prompt the subject's second mention is the indirect object's name, so the answers swap.
    `positions` holds, per row, the index of the first name (`a`), the second (`b`), the repeated
    name (`s2`) and the last token (`end`, where the answer is read); `io_first` says whether the
    indirect object is `a`.
    """

    clean_tokens: Int[Tensor, "batch seq"]
    corrupted_tokens: Int[Tensor, "batch seq"]
    correct: Int[Tensor, " batch"]
    incorrect: Int[Tensor, " batch"]
    template: Int[Tensor, " batch"]
    io_first: Bool[Tensor, " batch"]
    positions: dict[str, Int[Tensor, " batch"]]
    tokenizer: object = field(repr=False, default=None)

    def __len__(self) -> int:
        return self.clean_tokens.shape[0]

    @property
    def clean_text(self) -> list[str]:
        return self.tokenizer.batch_decode(self.clean_tokens, skip_special_tokens=True)

    @property
    def corrupted_text(self) -> list[str]:
        return self.tokenizer.batch_decode(self.corrupted_tokens, skip_special_tokens=True)


_SLOTS = {"a": "AAA", "b": "BBB", "c": "CCC", "place": "PPP", "object": "OOO"}


def template_ids(tokenizer) -> list[list[int | str]]:
    """Each template as token ids, with its slots left as the slot names ("a", "b", "c", ...)."""
    marker_slot = {" " + marker: slot for slot, marker in _SLOTS.items()}
    out = []
    for template in TEMPLATES:
        words = re.findall(WORD_PATTERN, template.format(**_SLOTS))
        out.append([marker_slot.get(w) or tokenizer.convert_tokens_to_ids(w) for w in words])
    return out


def make_ioi_prompts(n: int, seed: int, tokenizer=None, templates: tuple[int, ...] | None = None) -> IOIPrompts:
    """`n` IOI prompt pairs drawn with `seed` (the same seed gives the same prompts).

    Names, place, object, template and name order are drawn uniformly; the two names differ.
    `tokenizer` defaults to `build_tokenizer()`, which has the same ids as the embedded models'
    shipped tokenizer; `templates` restricts the draw to some of `TEMPLATES` by index.
    """
    if n < 1:
        raise ValueError(f"n={n} prompts: ask for at least one")
    chosen = torch.tensor(range(len(TEMPLATES)) if templates is None else list(templates), dtype=torch.long)
    if len(chosen) == 0 or bool(((chosen < 0) | (chosen >= len(TEMPLATES))).any()):
        raise ValueError(f"templates {chosen.tolist()} must be indices into the {len(TEMPLATES)} TEMPLATES")
    tokenizer = tokenizer or build_tokenizer()
    g = torch.Generator().manual_seed(seed)
    draw = lambda high: torch.randint(high, (n,), generator=g)  # noqa: E731
    ids_of = lambda words: torch.tensor(tokenizer.convert_tokens_to_ids([" " + w for w in words]))  # noqa: E731
    names, places, objects = ids_of(NAMES), ids_of(PLACES), ids_of(OBJECTS)
    template = chosen[draw(len(chosen))]
    io = draw(len(NAMES))
    s = (io + 1 + draw(len(NAMES) - 1)) % len(NAMES)  # any name but io
    io_first = draw(2) == 0
    io, s = names[io], names[s]
    fill = {"a": torch.where(io_first, io, s), "b": torch.where(io_first, s, io), "c": s,
            "place": places[draw(len(places))], "object": objects[draw(len(objects))]}

    clean = torch.full((n, PROMPT_LENGTH), tokenizer.bos_token_id, dtype=torch.long)
    positions = {k: torch.zeros(n, dtype=torch.long) for k in ("a", "b", "s2")}
    for t, ids in enumerate(template_ids(tokenizer)):
        rows = template == t
        for i, word in enumerate(ids, start=1):  # position 0 is BOS
            clean[rows, i] = fill[word][rows] if isinstance(word, str) else word
            if word in ("a", "b"):
                positions[word][rows] = i
            if word == "c":
                positions["s2"][rows] = i
    corrupted = clean.clone()
    corrupted[torch.arange(n), positions["s2"]] = io
    positions["end"] = torch.full((n,), PROMPT_LENGTH - 1)
    return IOIPrompts(clean_tokens=clean, corrupted_tokens=corrupted, correct=io, incorrect=s,
                      template=template, io_first=io_first, positions=positions, tokenizer=tokenizer)


def logit_difference(logits: Tensor, prompts: IOIPrompts, position: int = -1) -> Tensor:
    """logit(correct) - logit(incorrect) per prompt, at `position` of logits [batch seq vocab_size]."""
    last = logits[:, position]
    rows = torch.arange(last.shape[0])
    return last[rows, prompts.correct] - last[rows, prompts.incorrect]
