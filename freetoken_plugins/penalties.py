"""The penalties plugin (being written)."""
