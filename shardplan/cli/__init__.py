"""The `shardplan` command line: one small module per command."""
