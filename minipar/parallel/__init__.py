"""Parallelism techniques applied from outside the model, one per file."""
