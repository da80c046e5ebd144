"""Model adapters: one folder per upstream model server kind."""
