"""Framework integrations: linen, nnx, Equinox (README.md)."""
