"""The corpus: token windows or documents read from an array or a `datasets` dataset, documents
tokenized and packed into windows as SAELens packs them."""

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

# Column names read as token ids or as text when `column` is not given (SAELens's and transformers').
TOKEN_COLUMNS = ("tokens", "input_ids", "token_ids")
TEXT_COLUMNS = ("text",)


def require_datasets():
    """The `datasets` library (the corpus extra), imported when a corpus run needs it."""
    try:
        import datasets
        import datasets.arrow_writer  # noqa: F401
    except ImportError:
        raise ImportError("corpus runs need the datasets library: pip install 'hooked_models[corpus]'") from None
    return datasets


def _column(names: Sequence[str], column: str | None, what: str) -> str:
    if column is not None:
        if column not in names:
            raise ValueError(f"{what} has no column {column!r}; it has {', '.join(names)}")
        return column
    found = [c for c in (*TOKEN_COLUMNS, *TEXT_COLUMNS) if c in names]
    if not found:
        raise ValueError(f"{what} has no column named {' or '.join(TOKEN_COLUMNS + TEXT_COLUMNS)} "
                         f"(it has {', '.join(names)}); say which with column=")
    return found[0]


def open_dataset(dataset):
    """A `datasets` dataset from a dataset object or the path of one saved with save_to_disk."""
    datasets = require_datasets()

    if isinstance(dataset, (str, os.PathLike)):
        if not Path(dataset).is_dir():
            raise ValueError(f"dataset path {str(dataset)!r} is not a directory saved by datasets' save_to_disk")
        dataset = datasets.load_from_disk(str(dataset))
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise ValueError(f"dataset is a DatasetDict with splits {list(dataset)}; pass one split, e.g. dataset['train']")
    if not isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        raise ValueError("dataset must be token ids [n seq], a datasets.Dataset or IterableDataset, or the path "
                         f"of one saved on disk, not {type(dataset).__name__}")
    return dataset


@dataclass
class Corpus:
    """The corpus as batches of rows: token windows ("tokens") or documents ("text"), and a digest of
    the raw rows so a resumed harvest can tell it is given the same corpus."""

    kind: str
    column: str | None
    batches: Callable[[], Iterator]

    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"{self.kind} {self.column}".encode())
        for batch in self.batches():
            _digest_rows(digest, batch)
        return digest.hexdigest()


def _digest_rows(digest, batch) -> None:
    if isinstance(batch, np.ndarray):
        digest.update(f"{batch.shape}".encode())
        digest.update(np.ascontiguousarray(batch, dtype=np.int64).tobytes())
    else:
        for text in batch:
            encoded = text.encode()
            digest.update(len(encoded).to_bytes(8, "little") + encoded)


# Files of token ids [n seq] read as the corpus: what people keep a tokenized dataset in.
TOKEN_FILES = (".pt", ".npy", ".safetensors")


def token_ids(array, what: str = "token ids") -> np.ndarray:
    """`array` (a tensor or numpy array) as token windows [n seq], refused unless it is integers in 2 axes."""
    if isinstance(array, Tensor):  # checked before numpy, which has no bfloat16
        integer = not (array.is_floating_point() or array.is_complex() or array.dtype == torch.bool)
    else:
        integer = np.issubdtype(array.dtype, np.integer)
    if array.ndim != 2 or not integer:
        raise ValueError(f"{what} must be an integer array [n seq], got shape {tuple(array.shape)} {array.dtype}")
    return array.cpu().numpy() if isinstance(array, Tensor) else array


def read_token_file(path: str | os.PathLike, column: str | None = None) -> np.ndarray:
    """Token ids [n seq] from a .npy file, or a .pt or .safetensors file holding one tensor (or several, one of
    them named `column` or one of TOKEN_COLUMNS)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    if path.suffix == ".npy":
        return token_ids(np.load(path), f"the token ids in {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        tensors = torch.load(path, weights_only=True, map_location="cpu")
    if isinstance(tensors, dict) and tensors:
        if len(tensors) == 1 and column is None:
            name = next(iter(tensors))
        else:
            name = _column(list(tensors), column, str(path))
        tensors, path = tensors[name], f"{path} ({name})"
    if not isinstance(tensors, (Tensor, np.ndarray)):
        raise ValueError(f"{path} holds a {type(tensors).__name__}, not token ids [n seq] or a dict of tensors")
    return token_ids(tensors, f"the token ids in {path}")


def read_corpus(dataset, column: str | None, rows: int = 1024) -> Corpus:
    """The corpus in `dataset`: token ids [n seq] (an array, or a .pt/.npy/.safetensors file of them), or a
    `datasets` dataset (or the path of one saved with save_to_disk) of token windows or text."""
    if isinstance(dataset, (str, os.PathLike)) and Path(dataset).suffix in TOKEN_FILES:
        dataset, column = read_token_file(dataset, column), None
    if isinstance(dataset, (Tensor, np.ndarray)):
        array = token_ids(dataset)
        return Corpus("tokens", None, lambda: (array[i:i + rows] for i in range(0, len(array), rows)))
    dataset = open_dataset(dataset)
    names = list(dataset.column_names or next(iter(dataset)).keys())
    column = _column(names, column, "the dataset")
    feature = (dataset.features or {}).get(column)
    if feature is None:  # a streaming dataset may not know its features: look at a row
        kind = "text" if isinstance(next(iter(dataset))[column], str) else "tokens"
    else:
        kind = "text" if getattr(feature, "dtype", None) in ("string", "large_string") else "tokens"

    def batches():
        # Token windows come as numpy arrays (a list of lists per batch would cost a Python int per token).
        selected = dataset.select_columns([column])
        for batch in (selected if kind == "text" else selected.with_format("numpy")).iter(batch_size=rows):
            values = batch[column]
            if kind == "text":
                if values and not isinstance(values[0], str):
                    raise ValueError(f"column {column!r} holds {type(values[0]).__name__}, not text")
                yield values
                continue
            try:
                array = np.asarray(values.tolist() if values.dtype == object else values, dtype=np.int64)
            except (ValueError, TypeError):
                raise ValueError(f"the rows of token column {column!r} differ in length; give token windows "
                                 "of one length, or documents as a text column to be packed") from None
            if array.ndim != 2:
                raise ValueError(f"token column {column!r} must hold one list of ids per row, got shape "
                                 f"{array.shape}")
            yield array

    return Corpus(kind, column, batches)


def pack(documents: Iterable[Sequence[int]], context_size: int, bos: int | None) -> Iterator[list[int]]:
    """Documents' token ids -> windows of `context_size`, as SAELens packs them by default
    (`concat_and_batch_sequences` with BOS as the first token and the separator): each window starts
    with BOS, a document that starts inside a window is preceded by BOS, and the last partial window
    is dropped. A document or window that already starts with BOS gets no second one."""
    window: list[int] = []
    for doc in documents:
        offset = 0
        while offset < len(doc):
            if not window:
                if bos is not None and doc[offset] != bos:
                    window.append(bos)
            elif bos is not None and offset == 0 and doc[0] != bos:
                window.append(bos)
            take = context_size - len(window)
            window.extend(doc[offset:offset + take])
            offset += take
            if len(window) == context_size:
                yield window
                window = []


def window_batches(source: Corpus, model, context_size: int | None) -> tuple[Iterator[np.ndarray], int]:
    """Batches of token windows [rows context_size] and the context size, checked against the model."""
    if source.kind == "tokens":
        first = next(source.batches(), None)
        if first is None or len(first) == 0:
            raise ValueError("the dataset has no rows")
        width = first.shape[1]
        if context_size is not None and context_size != width:
            raise ValueError(f"context_size={context_size}, but the token windows are {width} tokens long; "
                             "give windows of that length or documents as a text column to be packed")
        context_size = width
        batches = source.batches()
    else:
        if context_size is None:
            raise ValueError(f"context_size is needed to pack text into windows (the model takes at most "
                             f"{model.max_positions} positions)")
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ValueError(f"the model has no tokenizer to tokenize text column {source.column!r}; "
                             "give token ids instead")
        bos = getattr(tokenizer, "bos_token_id", None)

        def documents():
            for texts in source.batches():
                yield from tokenizer(list(texts), add_special_tokens=False)["input_ids"]

        def batches():
            windows = []
            for window in pack(documents(), context_size, bos):
                windows.append(window)
                if len(windows) == 1024:
                    yield np.asarray(windows, dtype=np.int64)
                    windows = []
            if windows:
                yield np.asarray(windows, dtype=np.int64)

        batches = batches()
    _check_context(model, context_size)
    return batches, context_size


def _check_context(model, context_size: int) -> None:
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise ValueError(f"context_size={context_size!r} must be a positive integer")
    problem = model.length_problem(context_size)
    if problem is not None:
        raise ValueError(f"context_size={context_size}: {problem}; choose a context_size the model computes at")
