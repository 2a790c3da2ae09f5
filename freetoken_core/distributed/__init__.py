"""Tensor parallelism across processes: ``comm`` is how the ranks talk (issue #32)."""
