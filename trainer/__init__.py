"""The trainer job (`brigade trainer`): reads scored rollout shards from the bucket exactly once, trains the rank-1
LoRA with the GRPO loss on packed rows (rows.py plans them, packing.py runs the model on them, grpo.py builds them
and losses.py holds the loss), and every weight_sync_steps optimizer steps publishes an immutable adapter version
with its canary and a checkpoint of what it consumed. It never talks to vLLM. On a run with api = tinker it executes
a Tinker client's operations from the bucket instead (tinker/), through the same loss code path."""
