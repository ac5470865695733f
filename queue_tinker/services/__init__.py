"""Long-running services beside the workers: the recorder (Redis -> Postgres write-behind) and
the housekeeper (checkpoint expiry and deletion)."""
