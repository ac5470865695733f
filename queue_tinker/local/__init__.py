"""The embedded stack on one machine: embedded Redis and Postgres, child processes, `up`."""
