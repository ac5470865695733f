"""Every Redis key name queue_tinker uses, in one place (tests/queue/test_keys.py pins them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix, so deployments and test runs can share a Redis."""

    prefix: str

    # --- per model -------------------------------------------------------------------------
    def model_meta(self, model_id: str) -> str:
        """Hash: base_model, tenant_id, last_seq (assigned), done_seq (published)."""
        return f"{self.prefix}:model:{model_id}:meta"

    def model_ops(self, model_id: str) -> str:
        """Stream: the model's op log; entry id `<seq>-0`, so stream order is seq order."""
        return f"{self.prefix}:model:{model_id}:ops"

    def model_lease(self, model_id: str) -> str:
        """String `<worker_id>|<epoch>` with a TTL: who owns the model right now."""
        return f"{self.prefix}:model:{model_id}:lease"

    def model_epoch(self, model_id: str) -> str:
        """Counter bumped on every claim; the epoch is the lease's fencing token."""
        return f"{self.prefix}:model:{model_id}:epoch"

    def model_events(self, model_id: str) -> str:
        """Pub/sub channel: one message per finished job of the model (wakes futures)."""
        return f"{self.prefix}:model:{model_id}:events"

    def idempotency(self, model_id: str, key: str) -> str:
        """String: the job id first submitted under this idempotency key."""
        return f"{self.prefix}:model:{model_id}:idem:{key}"

    def model_held(self, model_id: str) -> str:
        """Hash: client seq_id -> op that arrived before its turn (Tinker protocol order)."""
        return f"{self.prefix}:model:{model_id}:held"

    def inflight_weights(self, model_id: str) -> str:
        """Hash: seq, path: the training run's newest inflight sampler weights (the save of
        that seq), which every inflight sampling session of the run samples from."""
        return f"{self.prefix}:model:{model_id}:inflight"

    # --- per sampling session: its clients and their batched polling (retrieve_futures) ------
    def sampler_clients(self, sampler_id: str) -> str:
        """Counter: the last client id join_sampling_session gave out (the original is 0)."""
        return f"{self.prefix}:model:{sampler_id}:clients"

    def sample_pending(self, sampler_id: str, client: int) -> str:
        """Set: request ids of one client's samples not yet reported by retrieve_futures."""
        return f"{self.prefix}:model:{sampler_id}:futures:{client}:pending"

    def sample_completions(self, sampler_id: str, client: int) -> str:
        """Sorted set: `<finished|failed>:<request id>` scored by its cursor number, kept until
        the client's next poll says it saw that cursor."""
        return f"{self.prefix}:model:{sampler_id}:futures:{client}:done"

    def sample_cursor(self, sampler_id: str, client: int) -> str:
        """Counter: the last cursor number given to a completion of this client."""
        return f"{self.prefix}:model:{sampler_id}:futures:{client}:cursor"

    # --- published checkpoints ----------------------------------------------------------
    def published_checkpoint(self, path: str) -> str:
        """String: the run id of a published checkpoint (its tinker:// path), which every
        tenant may sample from or load; absent when not published."""
        return f"{self.prefix}:published:{path}"

    # --- per job ---------------------------------------------------------------------------
    def job(self, job_id: str) -> str:
        """Hash: model_id, seq, kind, status, timings, worker, result or error."""
        return f"{self.prefix}:job:{job_id}"

    def job_reply(self, job_id: str) -> str:
        """String: how the gateway answers for a finished job when the kind alone does not say
        (a save that becomes a sampling session). Not under job:<id>: a request id of
        '<id>:reply' would then name this string as a job hash (WRONGTYPE, and an oracle)."""
        return f"{self.prefix}:reply:{job_id}"

    # --- per client session ----------------------------------------------------------------
    def session(self, session_id: str) -> str:
        """String: tenant_id of a gateway session (model ids are derived from session ids)."""
        return f"{self.prefix}:session:{session_id}"

    def session_samplers(self, session_id: str) -> str:
        """Set: the sampling sessions a gateway session opened
        (queue/control/silent_sessions.py)."""
        return f"{self.prefix}:session:{session_id}:samplers"

    def session_heartbeats(self) -> str:
        """Sorted set: gateway sessions that sent a session_heartbeat, scored by the last one
        (ms); a session silent past QT_SESSION_HEARTBEAT_TIMEOUT_S has its samples cancelled."""
        return f"{self.prefix}:session_heartbeats"

    # --- per base model --------------------------------------------------------------------
    def offers(self, base_model: str) -> str:
        """Sorted set: models with pending ops and no owner, scored by offer time."""
        return f"{self.prefix}:base:{base_model}:offers"

    def pending(self, base_model: str) -> str:
        """Set: models of this base with ops not yet published (the reaper scans it)."""
        return f"{self.prefix}:base:{base_model}:pending"

    def offer_bell(self, base_model: str) -> str:
        """Stream: one entry per offer, so every idle worker of the base wakes and picks the
        fairest offer (a pop would hand the oldest to one of them)."""
        return f"{self.offers(base_model)}:bell"

    def base_models(self) -> str:
        """Set: every base model a model was registered on (where the overview looks for
        pending models, instead of scanning the keyspace)."""
        return f"{self.prefix}:bases"

    def download_signing_secret(self) -> str:
        """String: the secret the gateways sign download URLs with (made once, random)."""
        return f"{self.prefix}:downloads:secret"

    def served_base_models(self) -> str:
        """Set: every base model a worker has served (added at each heartbeat, never removed):
        create_model refuses one that is not here."""
        return f"{self.prefix}:bases:served"

    # --- per tenant: limits and their live counts ------------------------------------------
    def limited_tenants(self) -> str:
        """Set: the tenants with limits of their own (and `*` once a default is set)."""
        return f"{self.prefix}:limits"

    def limits(self, tenant_id: str) -> str:
        """Hash: training_runs, inflight_ops, tokens_per_s (absent or 0 = unlimited); tenant
        `*` holds the default of every tenant without its own."""
        return f"{self.prefix}:limits:{tenant_id}"

    def tenant_leased(self, tenant_id: str) -> str:
        """Set: the tenant's models some worker holds a lease on (its training runs in use)."""
        return f"{self.prefix}:tenant:{tenant_id}:leased"

    def tenant_parked(self, tenant_id: str) -> str:
        """Set: the tenant's models refused a worker for its training-runs limit; offered
        again when one of its runs is released."""
        return f"{self.prefix}:tenant:{tenant_id}:parked"

    def tenant_running(self, tenant_id: str) -> str:
        """Set: the tenant's jobs started and not yet published (its in-flight ops)."""
        return f"{self.prefix}:tenant:{tenant_id}:running"

    def tenant_bucket(self, tenant_id: str) -> str:
        """Hash: level, at_ms: the tenant's token bucket (tokens_per_s limit)."""
        return f"{self.prefix}:tenant:{tenant_id}:bucket"

    # --- fleet-wide counters (Prometheus) ---------------------------------------------------
    def metrics_ops(self) -> str:
        """Hash: `<kind>|<status>` -> published ops."""
        return f"{self.prefix}:metrics:ops"

    def metrics_latency(self, kind: str) -> str:
        """Hash: `b<i>` -> ops whose queued-to-finished time fell in latency bucket i
        (queue/observe/metrics.py LATENCY_BUCKETS_S; i past the last bound is +Inf), count,
        sum_s."""
        return f"{self.prefix}:metrics:latency:{kind}"

    def metrics_tokens(self) -> str:
        """Hash: op kind -> tokens processed."""
        return f"{self.prefix}:metrics:tokens"

    def metrics_tenant_tokens(self) -> str:
        """Hash: tenant -> tokens processed."""
        return f"{self.prefix}:metrics:tenant-tokens"

    # --- fleet history (the dashboard's charts: queue/observe/history.py) -------------------
    def history_slot(self, bucket: int) -> str:
        """String, set NX with a TTL: the gateway that takes sample number `bucket` (Redis
        time // QT_HISTORY_INTERVAL_S), so replicas write one sample per interval."""
        return f"{self.prefix}:history:slot:{bucket}"

    def history_fleet(self) -> str:
        """Stream: one entry per sample, id `<sample ms>-0`: tokens (qt_tokens' total then),
        tokens_per_s (since the sample before); trimmed to QT_HISTORY_RETENTION_S."""
        return f"{self.prefix}:history:fleet"

    def history_base(self, base_model: str) -> str:
        """Stream: one entry per sample, id `<sample ms>-0`: the base model's depth,
        oldest_wait_s, workers; trimmed to QT_HISTORY_RETENTION_S."""
        return f"{self.prefix}:history:base:{base_model}"

    # --- workers ---------------------------------------------------------------------------
    def workers(self) -> str:
        """Sorted set: worker id -> last heartbeat (ms)."""
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """Hash: the worker's base model, device, host, pid, current op, owned models."""
        return f"{self.prefix}:worker:{worker_id}"

    def workers_loading(self) -> str:
        """Hash: worker id -> `<base model>|<started ms>|<last beat ms>` of a worker still
        loading its base model (not yet registered): a cold start, told to the waiting."""
        return f"{self.prefix}:workers:loading"

    def worker_control(self, worker_id: str) -> str:
        """Stream: wake-ups and commands for one worker's op reader."""
        return f"{self.prefix}:worker:{worker_id}:control"

    # --- the durable record ----------------------------------------------------------------
    def records(self) -> str:
        """Stream: record events the recorder writes behind into Postgres."""
        return f"{self.prefix}:records"

    def records_flush(self) -> str:
        """Stream: readers of Postgres asking the recorders to write what they hold now."""
        return f"{self.prefix}:records:flush"

    def records_written(self) -> str:
        """Stream: a bell each recorder rings after a batch is in Postgres (readers wait on it)."""
        return f"{self.prefix}:records:written"

    def replication_probe(self) -> str:
        """Counter: a write whose replication a process waits on when a WAIT fell short."""
        return f"{self.prefix}:replication:probe"

    def dead_records(self) -> str:
        """Stream: record events Postgres refused (constraint or data errors), kept to inspect."""
        return f"{self.prefix}:records:dead"

    # --- housekeeping (rq) -----------------------------------------------------------------
    def housekeeping_queue(self) -> str:
        """rq queue name (not a key: rq keeps it under `rq:queue:<name>` and friends) of the
        housekeeper's jobs, e.g. checkpoint expiry."""
        return f"{self.prefix}-housekeeping"
