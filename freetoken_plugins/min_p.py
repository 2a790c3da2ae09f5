"""The min_p plugin (being written)."""
