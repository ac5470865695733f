"""What every benchmark shares around its measurement, one job a module:

- services: the Redis and Postgres URLs (or embedded servers), scratch databases, fresh key
  prefixes, settings for child processes, clients closed without hanging, job timestamps
- workers, gateway: the worker and `queue-tinker serve` processes a benchmark runs against
- run, cli: one run's clock, data directory and scratch database; the common options
- machine, report: the machine line; docs sections, tables and raw JSON
- data, models, baselines: datums and prompts; built-in and random models, adapters through
  the worker's AdapterPool; the bare PEFT loop and `generate()` the service is held against
- engine: the engine's training calls, the only module that reaches workers/training
- meters, stats, isolated: CPU, memory and time beside the measurement; latency and
  throughput as data; a case in a process of its own
"""
