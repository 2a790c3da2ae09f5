"""The min_tokens plugin (being written)."""
