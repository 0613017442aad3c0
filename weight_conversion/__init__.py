"""Converters from source checkpoints to hooked models, and back. Imports hooked_models, never the reverse."""
