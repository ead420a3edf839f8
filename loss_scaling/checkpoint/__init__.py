"""Saving and restoring loss scales: one module per format (README.md)."""
