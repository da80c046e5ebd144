"""Rollout records: the schema, token contiguity, training sequences, and the tools that read them back."""
