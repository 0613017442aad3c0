"""Converters from source checkpoints to hooked models, and back."""

# For developers: this package imports hooked_models, never the reverse (the contract in pyproject.toml).
