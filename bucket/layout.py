"""Where every object lives in the bucket, and who writes it.

run.json                                   written once (first trainer or `brigade init`); read by every job
adapters/v000001/CLAIM.json                trainer, FIRST, created exclusively: the version name is taken
adapters/v000001/adapter_model.safetensors trainer; read by replicas (or their mirror)
adapters/v000001/adapter_config.json       trainer
adapters/v000001/COMMITTED.json            trainer, LAST: checksums of the files above
adapters/LATEST.json                       trainer, after COMMITTED: {"version": 1}
rollouts/<worker>/<part>/<seq>.json        rollout worker; read once by the trainer
events/<writer>/<part>/<seq>.json          every job: timestamped events
events/<writer>/<part>.jsonl.gz            that writer, once <part> is complete: its records, which it then
                                           deletes (bucket/log_archive.py); readers read it transparently
replicas/<replica_id>.json                 replica sidecar (heartbeat rewrites it); read by the proxy
trainer/checkpoints/v000001/...            trainer, before the adapter's COMMITTED: optimizer state + what it consumed
trainer/LATEST.json                        trainer, after the checkpoint
trainer/progress.json                      trainer, every step: its cursors (rollout workers' backpressure)
trainer/DONE.json                          trainer, when it reached max_steps
trainer/retention.json                     trainer: how far its retention has gone (trainer/retention.py)
rollout_workers/<worker>/data_cursor.json  rollout worker, after every shard: where it is in its prompts
proxy/live.json                            proxy, when its live adapters change; read by replica mirrors
proxy/drains/<replica_id>.json             proxy, when it sees a replica draining and again when nothing of its
                                           traffic is left there (released); read by that replica's sidecar

Version folders (v000001) and the keys, names and paths built from them: bucket/version.py.

Deletion has one owner, the trainer, after each publish (trainer/retention.py, [run] keep_adapters,
keep_checkpoints, keep_rollouts): old adapter versions (COMMITTED.json first, so a half-deleted version
reads as abandoned), old checkpoints' optimizer state (state.json stays: the ledger), consumed shards.
Events are never deleted, only archived by their own writer.
"""

from __future__ import annotations

RUN_MANIFEST = "run.json"
ADAPTERS = "adapters"
ADAPTERS_LATEST = f"{ADAPTERS}/LATEST.json"
COMMIT_MARKER = "COMMITTED.json"
ROLLOUTS = "rollouts"
EVENTS = "events"
REPLICAS = "replicas"
CHECKPOINTS = "trainer/checkpoints"
CHECKPOINT_LATEST = "trainer/LATEST.json"
TRAINER_PROGRESS = "trainer/progress.json"
TRAINER_DONE = "trainer/DONE.json"
RETENTION = "trainer/retention.json"
ROLLOUT_WORKERS = "rollout_workers"
PROXY_LIVE = "proxy/live.json"
PROXY_DRAINS = "proxy/drains"


def data_cursor_key(worker: str) -> str:
    return f"{ROLLOUT_WORKERS}/{worker}/data_cursor.json"
