"""The stop_tokens plugin (being written)."""
