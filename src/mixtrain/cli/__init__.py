"""The `mixtrain` command line."""
