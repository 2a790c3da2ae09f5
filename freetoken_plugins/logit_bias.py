"""The logit_bias plugin (being written)."""
