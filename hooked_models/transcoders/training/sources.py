"""Where training batches come from: the live model streamed through a shuffling buffer, or a harvest on disk.

Both give `batch()`: this process's share of the next global batch, every trained layer's MLP inputs and
outputs [layer tokens hidden_size] in float32, the same global batch however many processes share it; and
`state()` / `load_state()`, what a checkpoint needs to resume the stream exactly.

`StreamingSource` runs the frozen model over the dataset (any dtype; only the layers up to the last one
trained) as training consumes it, and mixes many contexts into each batch through a buffer as SAELens's
mixing buffer and dictionary_learning's ActivationBuffer do: fill it to `buffer_tokens`, shuffle, hand out
half, refill. Memory is bounded by the buffer, never by the corpus. The data is split into `streams`
(window i belongs to stream i mod streams), each with a buffer of its own and each process running its
streams, so that a batch is the same whether one process or several compute it.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from hooked_models.transcoders.identity import ModelIdentity, input_hook_name, output_hook_name

_FAMILIES_BY_CLASS = {"HookedArcee": "arcee", "HookedAlphaEr": "alpha_er"}


class HarvestReader:
    """Batches of (MLP inputs, MLP outputs) of every layer from a `corpus.harvest` on disk, drawn at
    random rows of the memory-mapped dataset: one batch in memory, whatever the corpus's size."""

    def __init__(self, path: str | os.PathLike):
        import datasets

        self.path = Path(path)
        manifest_file = self.path / "manifest.json"
        if not manifest_file.is_file():
            raise FileNotFoundError(f"no manifest.json in {self.path}: not a corpus.harvest output")
        manifest = json.loads(manifest_file.read_text())
        if not manifest.get("complete"):
            raise ValueError(f"the harvest in {self.path} is not complete: rerun corpus.harvest to finish it")
        model, config = manifest["model"], manifest["model"]["config"]
        family = _FAMILIES_BY_CLASS.get(model["family"])
        if family is None:
            raise ValueError(f"{self.path} is a harvest of a {model['family']}, not a hooked model family")
        self.identity = ModelIdentity(family, int(config.get("hidden_size", config.get("n_embd"))),
                                      int(config.get("num_layers", config.get("n_layer"))))
        names = [name for l in range(self.identity.num_layers) for name in (input_hook_name(l), output_hook_name(l))]
        missing = [name for name in names if name not in manifest["names"]]
        if missing:
            raise ValueError(f"the harvest in {self.path} lacks {', '.join(missing)}: transcoders of every layer "
                             f"train on {', '.join(names)}")
        self.names, self.context_size = names, int(manifest["context_size"])
        self.dataset = datasets.load_from_disk(str(self.path)).with_format("numpy", columns=names)
        self.rows = len(self.dataset)

    def batch(self, step: int, tokens: int, seed: int, share: tuple[int, int] = (0, 1)) -> tuple[Tensor, Tensor]:
        """Step `step`'s batch, the same on every run: inputs and outputs [layer tokens hidden_size]; with
        `share=(i, n)`, the i-th of n equal parts of its rows."""
        rows = max(1, -(-tokens // self.context_size))
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        index = torch.randint(0, self.rows, (rows,), generator=generator).sort().values
        part, parts = share
        index = index[part * rows // parts:(part + 1) * rows // parts].tolist()
        data = self.dataset[index]

        def stack(names):  # [layer tokens hidden_size]
            return torch.stack([torch.from_numpy(data[n]).reshape(-1, data[n].shape[-1]) for n in names])

        return stack(self.names[0::2]), stack(self.names[1::2])


class HarvestSource:
    """A harvest on disk as a training source: step s's global batch of random rows, split among processes
    (its rows must divide evenly among them)."""

    def __init__(self, reader: HarvestReader, layers: list[int], batch_tokens: int, seed: int,
                 share: tuple[int, int]):
        rows = max(1, -(-batch_tokens // reader.context_size))
        if rows % share[1]:
            raise ValueError(f"batch_tokens={batch_tokens} is {rows} rows of the harvest's {reader.context_size} "
                             f"tokens, which do not divide among {share[1]} processes")
        self.reader, self.layers, self.batch_tokens, self.seed, self.share = reader, layers, batch_tokens, seed, share
        self.identity, self.step = reader.identity, 0

    def batch(self) -> tuple[Tensor, Tensor]:
        x, y = self.reader.batch(self.step, self.batch_tokens, self.seed, self.share)
        self.step += 1
        return x[self.layers].float(), y[self.layers].float()

    def state(self) -> dict:
        return {"step": self.step}

    def load_state(self, state: dict) -> None:
        self.step = int(state["step"])


class _Stream:
    """One stream of the data: windows i ≡ index (mod count), run through the model, mixed in a buffer."""

    def __init__(self, owner: "StreamingSource", index: int):
        self.owner, self.index = owner, index
        self.generator = torch.Generator().manual_seed(owner.seed * 7919 + index)
        self.epoch, self.windows = 0, 0  # windows of this stream consumed in the current epoch
        self.buffer: Tensor | None = None  # [tokens 2 layer hidden_size], model dtype: waiting to be mixed
        self.ready: Tensor | None = None  # mixed, handed out from the front
        self._rows = None

    def _next_windows(self, n: int) -> np.ndarray | None:
        """Up to n more windows of this stream, None at the end of the data."""
        if self._rows is None:
            self._rows = self._windows_from(self.windows)
        out = []
        for row in self._rows:
            out.append(row)
            if len(out) == n:
                break
        if not out:
            return None
        self.windows += len(out)
        return np.stack(out)

    def _windows_from(self, skip: int):
        count, mine = self.owner.streams, 0
        i = 0
        for batch in self.owner.batches():
            for row in batch:
                if i % count == self.index:
                    if mine >= skip:
                        yield row
                    mine += 1
                i += 1

    def _fill(self, tokens: int) -> None:
        """Run the model until the buffer holds `tokens` tokens (the data repeats, epoch after epoch)."""
        have = 0 if self.buffer is None else len(self.buffer)
        parts = [] if self.buffer is None else [self.buffer]
        while have < tokens:
            windows = self._next_windows(self.owner.forward_batch)
            if windows is None:
                if self.epoch == 0 and self.windows * self.owner.context_size < self.owner.share_tokens:
                    raise ValueError(
                        f"the dataset is too small for one batch: stream {self.index} of {self.owner.streams} has "
                        f"{self.windows} windows of {self.owner.context_size} tokens, and a batch needs "
                        f"{self.owner.share_tokens} tokens from each stream "
                        f"(batch_tokens={self.owner.batch_tokens} in all)")
                self.epoch, self.windows, self._rows = self.epoch + 1, 0, None
                continue
            acts = self.owner.activations(torch.from_numpy(windows))
            parts.append(acts)
            have += len(acts)
        self.buffer = torch.cat(parts) if len(parts) > 1 else parts[0]

    def take(self, n: int) -> Tensor:
        """The next n mixed tokens [n 2 layer hidden_size]."""
        capacity = self.owner.stream_buffer
        while self.ready is None or len(self.ready) < n:
            if capacity == 0:  # no mixing: the data's own order
                self._fill(n)
                moved, self.buffer = self.buffer, None
            else:
                self._fill(capacity)
                mixed = self.buffer[torch.randperm(len(self.buffer), generator=self.generator)]
                half = len(mixed) // 2
                moved, self.buffer = mixed[:half], mixed[half:]
            self.ready = moved if self.ready is None else torch.cat([self.ready, moved])
        out, self.ready = self.ready[:n], self.ready[n:]
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "windows": self.windows, "buffer": self.buffer, "ready": self.ready,
                "generator": self.generator.get_state()}

    def load_state(self, state: dict) -> None:
        self.epoch, self.windows = int(state["epoch"]), int(state["windows"])
        self.buffer, self.ready, self._rows = state["buffer"], state["ready"], None
        self.generator.set_state(state["generator"])


class StreamingSource:
    """The frozen model's MLP inputs and outputs over `dataset`, computed as training consumes them."""

    def __init__(self, model, dataset, layers: list[int], *, batch_tokens: int, buffer_tokens: int,
                 forward_batch: int, streams: int, share: tuple[int, int], seed: int,
                 context_size: int | None = None, column: str | None = None):
        from hooked_models.corpus.data import read_corpus, window_batches

        part, parts = share
        if streams % parts:
            raise ValueError(f"streams={streams} do not divide among {parts} processes: choose a multiple of {parts}")
        if batch_tokens % streams:
            raise ValueError(f"batch_tokens={batch_tokens} does not divide among streams={streams}")
        self.model, self.layers, self.identity = model, layers, ModelIdentity.of(model)
        self.batch_tokens, self.streams, self.seed, self.forward_batch = batch_tokens, streams, seed, forward_batch
        self.share_tokens = batch_tokens // streams
        self.stream_buffer = buffer_tokens // streams if buffer_tokens else 0
        if self.stream_buffer and self.stream_buffer < 2 * self.share_tokens:
            raise ValueError(f"buffer_tokens={buffer_tokens} must hold at least two batches ({2 * batch_tokens} "
                             "tokens), or be 0 for batches in the data's order")
        corpus = read_corpus(dataset, column)
        first, self.context_size = window_batches(corpus, model, context_size)
        del first
        self.batches = lambda: window_batches(corpus, model, self.context_size)[0]
        self.names = [name for l in layers for name in (input_hook_name(l), output_hook_name(l))]
        self.mine = [_Stream(self, i) for i in range(part * streams // parts, (part + 1) * streams // parts)]

    @torch.no_grad()
    def activations(self, tokens: Tensor) -> Tensor:
        """[tokens 2 layer hidden_size] of windows [n seq]: the model run up to the last layer trained."""
        device = next(self.model.parameters()).device
        _, cache = self.model.run_with_cache(tokens.to(device), names_filter=self.names,
                                             stop_at_layer=self.layers[-1] + 1)
        acts = torch.stack([torch.stack([cache[input_hook_name(l)], cache[output_hook_name(l)]]) for l in self.layers])
        return acts.flatten(2, 3).permute(2, 1, 0, 3).cpu()  # [layer 2 (n seq) d] -> [(n seq) 2 layer d]

    def batch(self) -> tuple[Tensor, Tensor]:
        both = torch.cat([stream.take(self.share_tokens) for stream in self.mine]).float()
        return both[:, 0].transpose(0, 1).contiguous(), both[:, 1].transpose(0, 1).contiguous()

    def state(self) -> dict:
        return {"streams": [stream.state() for stream in self.mine]}

    def load_state(self, state: dict) -> None:
        for stream, saved in zip(self.mine, state["streams"], strict=True):
            stream.load_state(saved)
