"""`TrainingConfig`: what `train_transcoders` trains, and how; every value checked where it is given."""

from dataclasses import dataclass, fields

from hooked_models.transcoders.activation_functions import check_size

TRAINED_ACTIVATIONS = ("relu", "topk", "batchtopk", "jumprelu")
INITS = ("tied", "zero_decoder", "unit_decoder")
SPREADS = ("equal", "drawn")
PENALTIES = ("tanh", "l0")
LAYOUTS = ("data", "features")


@dataclass(frozen=True)
class TrainingConfig:
    """What `train_transcoders` trains, and how.

    The loss per step is, summed over the layers (targets) trained, the fraction of variance unexplained of
    the MLP output (sparsify's FVU: Σ|y - ŷ|² / Σ|y - ȳ|² over the global batch), plus

    - TopK and BatchTopK: `auxk_alpha` times the AuxK loss (Gao et al. 2024, as sparsify computes it): the
      `d_out // 2` most active *dead* features (none fired for `dead_tokens` tokens) reconstruct the
      residual y - ŷ, scaled by min(dead / (d_out // 2), 1); off with auxk_alpha=0.
    - ReLU: `sparsity` times the features' L1 weighted by their decoder norms (Anthropic's, SAELens's).
    - JumpReLU: `sparsity` times Σ tanh(`tanh_scale` · f · ‖W_dec‖) (Anthropic's January 2025 update,
      penalty="tanh") or the L0 through the straight-through step (Rajamanoharan et al. 2024, penalty="l0"),
      plus `pre_act_loss` times Σ relu(θ - pre) ‖W_dec‖ (Anthropic's pre-activation loss, which pulls dead
      features back over their thresholds).

    BatchTopK (Bussmann et al. 2024) keeps the k·B largest activations of a batch of B tokens; the features
    it saves are JumpReLUs whose threshold is the running mean of the smallest kept activation (`k` stays
    the average L0). Adam at `lr`, warmed up linearly over `warmup_steps` (default None: the first tenth of
    the steps, at most 1,000, sparsify's warm-up), then decayed linearly to zero over the last
    `decay_fraction` of the steps.

    init: "tied" (default: encoder as torch.nn.Linear draws it, decoder its transpose with rows scaled to
    norm `init_scale`), "zero_decoder" (sparsify's transcoder initialization) or "unit_decoder" (this
    package's earlier one: unit decoder rows, the encoder their transpose). In each, the decoder bias starts
    at the first batch's mean output and the encoder bias centres the first batch's pre-activations
    (b_enc = -mean(x) @ W_enc, as sparsify does). init_spread="equal" first scales each feature's encoder column so
    that its pre-activations spread over the first batch as much as the average feature's do (their standard
    deviation the mean over the features): a feature whose random direction misses the span the data fills
    would otherwise seldom enter a TopK, get no gradient and stay dead; "drawn" (default) keeps the columns.

    Across processes: `layout="data"` (each process its share of every batch, gradients all-reduced) or
    "features" (each process 1/N of every layer's features; the batch gathered). `streams` fixes how the
    streamed data is split (None: one per process) so that N processes train what one process trains.
    """

    d_transcoder: int = 256
    activation: str = "relu"
    k: int | None = None
    skip: bool = False
    cross_layer: bool = False
    layers: tuple[int, ...] | None = None  # per-layer transcoders of these layers only (default: every layer)
    steps: int = 2000
    batch_tokens: int = 1024
    lr: float = 2e-3
    warmup_steps: int | None = None  # None: steps // 10, at most 1,000 (`warmup`)
    decay_fraction: float = 0.2
    init: str = "tied"
    init_scale: float = 0.1
    init_spread: str = "drawn"
    auxk_alpha: float = 1 / 32
    dead_tokens: int = 1_000_000
    sparsity: float = 1e-3
    penalty: str = "tanh"
    tanh_scale: float = 4.0
    pre_act_loss: float = 0.0
    threshold: float = 0.01  # JumpReLU's initial threshold
    bandwidth: float = 0.05  # JumpReLU's straight-through kernel width
    threshold_momentum: float = 0.01  # BatchTopK: the running threshold's update weight
    buffer_tokens: int = 65_536  # streamed: the shuffling buffer (0: batches in the data's order)
    forward_batch: int = 32  # streamed: windows per forward of the model
    layout: str = "data"
    streams: int | None = None
    seed: int = 0
    checkpoint_every: int = 250
    log_every: int = 10

    def __post_init__(self):
        for name in ("d_transcoder", "steps", "batch_tokens", "checkpoint_every", "log_every", "forward_batch",
                     "dead_tokens"):
            check_size(name, getattr(self, name))
        for name in ("warmup_steps", "buffer_tokens"):
            value = getattr(self, name)
            if name == "warmup_steps" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        if self.activation not in TRAINED_ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} must be one of {', '.join(TRAINED_ACTIVATIONS)}")
        if self.activation in ("topk", "batchtopk"):
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= self.d_transcoder:
                raise ValueError(f"k={self.k!r}: {self.activation} needs an integer k in [1, d_transcoder="
                                 f"{self.d_transcoder}]")
        elif self.k is not None:
            raise ValueError(f"k={self.k!r} is for activation='topk' or 'batchtopk', not {self.activation!r} "
                             "(pass k=None)")
        for name, allowed in (("init", INITS), ("init_spread", SPREADS), ("penalty", PENALTIES), ("layout", LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(allowed)}")
        positive = ("lr", "bandwidth", "tanh_scale", "init_scale")
        for name in (*positive, "sparsity", "threshold", "auxk_alpha", "pre_act_loss", "decay_fraction",
                     "threshold_momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    name in positive and value == 0):
                raise ValueError(f"{name}={value!r} must be a {'positive' if name in positive else 'non-negative'}"
                                 " number")
        if self.decay_fraction > 1 or self.threshold_momentum > 1:
            name = "decay_fraction" if self.decay_fraction > 1 else "threshold_momentum"
            raise ValueError(f"{name}={getattr(self, name)!r} must be at most 1")
        if self.streams is not None:
            check_size("streams", self.streams)
        if self.layers is not None:
            if self.cross_layer:
                raise ValueError(f"layers={self.layers!r}: a cross-layer transcoder spans every layer")
            layers = tuple(self.layers)
            if not layers or any(isinstance(l, bool) or not isinstance(l, int) or l < 0 for l in layers) or (
                    len(set(layers)) != len(layers)):
                raise ValueError(f"layers={self.layers!r} must be distinct non-negative layer indices")
            object.__setattr__(self, "layers", tuple(sorted(layers)))

    @property
    def warmup(self) -> int:
        """The warm-up's length in steps: `warmup_steps`, or a tenth of the steps (at most 1,000) where it is None.
        A short warm-up keeps the first large steps at a high lr from killing features, FVU no worse (the
        embedded recipe at a tuned lr: benchmarks/transcoder_training.py, its results in benchmarks/README.md)."""
        return min(self.steps // 10, 1000) if self.warmup_steps is None else self.warmup_steps

    def replace(self, **changes) -> "TrainingConfig":
        """A copy with `changes`; an unknown name is a ValueError naming it."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"TrainingConfig has no field {', '.join(map(repr, unknown))}")
        return TrainingConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})
