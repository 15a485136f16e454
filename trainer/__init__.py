"""The trainer job (`brigade trainer`): reads scored rollout shards from the bucket exactly once, trains the rank-1
LoRA with the GRPO loss on packed rows (rows.py plans them, packing.py runs the model on them, grpo.py), and every
weight_sync_steps optimizer steps publishes an immutable adapter version with its canary and a checkpoint of what
it consumed. It never talks to vLLM."""
