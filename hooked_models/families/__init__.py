"""Hooked model families: each a short recipe over the shared components."""
