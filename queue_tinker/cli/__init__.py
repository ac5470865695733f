"""The `queue-tinker` command line (main.py) and its subcommands: status, keys, limits, demo."""
