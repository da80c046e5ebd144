"""The `ngt` command line: one module per subcommand."""
