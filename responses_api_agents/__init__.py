"""Agents: servers that play episodes (seed, model <-> tools/environment, verify); one folder each."""
