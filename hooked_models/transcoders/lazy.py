"""`LazyTranscoderSet`: a saved per-layer set read from its safetensors files as it is used, so that the
transcoders of a large model need not all be resident (circuit-tracer's `lazy_encoder` / `lazy_decoder`).

    tcs = load_transcoders("out/tc", model=model, lazy=True)    # reads config.yaml and the files' headers
    tcs.encode(3, x)                    # layer 3's transcoder read from layer_3.safetensors, kept until another
    tcs.decoder_rows(3, 3, ids)         # only those rows of W_dec, read from the file
    tcs.encoder_columns(3, ids)         # only those features' encoder directions

It answers as the `TranscoderSet` it was saved from, value for value: `encode`, `decode_to`, `decoder`,
`encoder` and `self[layer]` use a whole layer's transcoder, read from its file and held until another
layer is asked for (one layer resident at a time); `decoder_rows` and `encoder_columns` read only the
rows they return (safetensors' sliced reads). Reading a file again costs its size in I/O, so work that
goes layer by layer (the attribution's forward passes do) reads each file once. `spliced_modules`,
`iter` and `transcoders` read every layer: splicing a set into the model makes it resident.
"""

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from hooked_models.transcoders.files import resolve_path
from hooked_models.transcoders.single_layer_transcoder import Transcoder, TranscoderSet


class LazyTranscoderSet(TranscoderSet):
    """A `TranscoderSet` whose layers stay in their files until used (see the module docstring).

    Made by `load_transcoders(path, lazy=True)` or `LazyTranscoderSet.load(path)`; `dtype` and `device`
    apply to what is read. Holds no parameters: nothing of it trains, and `.to()` sets where reads go."""

    def __init__(self, path: Path, files: list[Path], activation: str | None, k: int | None, identity,
                 dtype: torch.dtype | None = None, device=None):
        super(TranscoderSet, self).__init__(identity)  # SetBase's: no resident transcoders to check
        self.path, self.files, self._activation, self._k = path, files, activation, k
        self._dtype, self._device = dtype, device
        self._held: tuple[int, Transcoder] | None = None
        self._smalls: dict[tuple[int, str], Tensor] = {}  # b_dec and W_skip, read once
        with safe_open(str(files[0]), "pt") as f:
            names = set(f.keys())
            d_transcoder, d_in = f.get_slice("W_enc").get_shape()
            d_out = f.get_slice("W_dec").get_shape()[1]
            stored = f.get_slice("W_enc").get_dtype()
        if self._activation is None:
            self._activation = ("jumprelu" if "activation_function.threshold" in names
                                else "topk" if "k" in names else "relu")
        self._shape = (d_in, d_transcoder, d_out, "W_skip" in names)
        self._stored_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                              "F64": torch.float64}.get(stored, torch.float32)
        for layer, file in enumerate(files[1:], 1):  # every file the same shape, checked on its header alone
            with safe_open(str(file), "pt") as f:
                shape = (*f.get_slice("W_enc").get_shape(), f.get_slice("W_dec").get_shape()[1])
            if shape != (d_transcoder, d_in, d_out):
                raise ValueError(f"{file}: W_enc {shape[:2]} and W_dec width {shape[2]}; layer 0's are "
                                 f"{(d_transcoder, d_in)} and {d_out}: a set's transcoders share their shape")
        if self.identity is not None and self.identity.num_layers != len(files):
            raise ValueError(f"{len(files)} transcoders for a model of {self.identity.num_layers} layers")

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, dtype: torch.dtype | None = None,
             device=None) -> "LazyTranscoderSet":
        """A set saved by `TranscoderSet.save` (or circuit-tracer), read lazily; "embedded": the shipped one."""
        path = resolve_path(path, model)
        config = cls._read_config(path, cls.model_kind)
        files = []
        for name in config.get("transcoders") or []:
            file = Path(name) if Path(name).is_absolute() else path / name
            if not file.is_file():
                raise FileNotFoundError(f"{path / 'config.yaml'} lists {name}, which does not exist")
            files.append(file)
        if not files:
            raise ValueError(f"{path / 'config.yaml'} lists no transcoders")
        k = int(config["k"]) if config.get("k") is not None else None
        tcs = cls(path, files, config.get("activation") or None, k, cls._identity_from(config), dtype, device)
        if model is not None:
            tcs.check_model(model)
        return tcs

    # ----------------------------------------------------------------------- what a set answers
    n_layers = property(lambda self: len(self.files))
    d_in = property(lambda self: self._shape[0])
    d_transcoder = property(lambda self: self._shape[1])
    d_out = property(lambda self: self._shape[2])
    has_skip = property(lambda self: self._shape[3])
    activation = property(lambda self: self._activation)
    dtype = property(lambda self: self._dtype or self._stored_dtype)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, layer: int) -> Transcoder:
        """Layer `layer`'s whole transcoder, read from its file (the one held, when it is that layer's)."""
        layer = self._layer(layer)
        if self._held is None or self._held[0] != layer:
            self._held = None  # the previous layer's released before the next is read
            self._held = (layer, self._read(layer))
        return self._held[1]

    def __iter__(self):
        return (self[layer] for layer in range(self.n_layers))

    @property
    def transcoders(self) -> list[Transcoder]:
        """Every layer's transcoder, read (all resident, as long as the list is kept)."""
        return [self._read(layer) for layer in range(self.n_layers)]

    def spliced_modules(self) -> list[Transcoder]:
        return self.transcoders

    def encoder_columns(self, layer: int, ids: Tensor | Sequence[int]) -> Tensor:
        """[d_in n]: the encoder directions of features `ids` of layer `layer` (only those read)."""
        with safe_open(str(self.files[self._layer(layer)]), "pt") as f:
            return self._cast(f.get_slice("W_enc")[self._ids(ids)]).T  # on disk [d_transcoder d_in]

    def decoder_rows(self, source: int, target: int, ids: Tensor | Sequence[int]) -> Tensor:
        """[n d_out]: the decoder rows of features `ids` of layer `source` (only those read)."""
        self._writes_only_itself(source, target)
        with safe_open(str(self.files[source]), "pt") as f:
            return self._cast(f.get_slice("W_dec")[self._ids(ids)])

    def decode_to(self, layer: int, acts_by_source_layer, x: Tensor | None = None) -> Tensor:
        """As `TranscoderSet.decode_to`; a layer with no feature active writes its b_dec (and skip
        connection) without its decoder being read."""
        acts = acts_by_source_layer[self._layer(layer)]
        if bool(acts.any()):
            return super().decode_to(layer, acts_by_source_layer, x)
        b_dec = self._small(layer, "b_dec")
        out = torch.zeros(*acts.shape[:-1], self.d_out, dtype=b_dec.dtype, device=b_dec.device) + b_dec
        if self.has_skip:
            if x is None:
                raise ValueError(f"layer {layer}'s transcoder has a skip connection: pass its input x")
            w_skip = self._small(layer, "W_skip")
            out = out + x.to(w_skip.dtype) @ w_skip.T
        return out

    def skip_weight(self, layer: int) -> Tensor | None:
        """As `TranscoderSet.skip_weight`, read on its own (the layer's other tensors stay in its file)."""
        return self._small(self._layer(layer), "W_skip") if self.has_skip else None

    def _apply(self, fn, recurse=True):
        """`.to(dtype=, device=)`: where and as what later reads go (no tensor is resident to move)."""
        probe = fn(torch.zeros((), dtype=self.dtype, device=self._device))
        self._dtype = probe.dtype if probe.is_floating_point() else self._dtype
        self._device = probe.device
        self._held, self._smalls = None, {}
        return self

    def extra_repr(self) -> str:
        return (f"{self.n_layers} layers read lazily from {self.path}, {self.d_in} -> {self.d_transcoder} -> "
                f"{self.d_out}, {self.activation}{', skip' if self.has_skip else ''}")

    # ----------------------------------------------------------------------------------- reading
    def _read(self, layer: int) -> Transcoder:
        file = self.files[layer]
        with safe_open(str(file), "pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}
        if self._activation == "topk" and "k" not in state:
            state["k"] = torch.tensor(self.k)
        tc = Transcoder.from_file_state(state, layer, self._activation, where=str(file))
        del state
        return tc.to(dtype=self._dtype, device=self._device).requires_grad_(False)

    def _small(self, layer: int, name: str) -> Tensor:
        if (layer, name) not in self._smalls:
            with safe_open(str(self.files[layer]), "pt") as f:
                self._smalls[layer, name] = self._cast(f.get_tensor(name))
        return self._smalls[layer, name]

    @property
    def k(self) -> int | None:
        if self._activation != "topk":
            return None
        if self._k is None:
            with safe_open(str(self.files[0]), "pt") as f:
                self._k = int(f.get_tensor("k")) if "k" in f.keys() else None
        return self._k

    def _ids(self, ids) -> Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long).cpu().flatten()
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.d_transcoder):
            raise ValueError(f"feature ids must lie in [0, {self.d_transcoder}); got {ids.min()} ... {ids.max()}")
        return ids

    def _cast(self, t: Tensor) -> Tensor:
        return t.to(dtype=self._dtype or t.dtype, device=self._device or t.device)
