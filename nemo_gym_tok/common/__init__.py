"""Small helpers every layer may use: another server's error text, free ports, the cache directory."""
