"""Benchmarks: run with real Redis, Postgres and worker processes (see docs/benchmarks.md)."""
