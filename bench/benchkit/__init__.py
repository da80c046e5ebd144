"""Shared code of the bench scripts, one module per job (bench/README.md)."""
