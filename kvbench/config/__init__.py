"""The Hydra config tree: where it lives, what it offers, and the one set of argument checks."""
