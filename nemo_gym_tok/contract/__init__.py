"""The token contract's rules: which source of ids wins, Responses/chat conversion keeping bundles, provenance."""
