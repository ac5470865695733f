"""Checkpoint storage: where checkpoints, snapshots and markers live, behind one narrow
interface (base.py) with a local-directory store (local.py) and an S3 one (s3.py).

Knows no Redis, no SQL, no torch and no settings: the workers' engines use it, and so do the
gateway, the housekeeper and the REST client; configured.py builds the configured store.
"""
