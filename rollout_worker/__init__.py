"""The rollout worker job (`brigade rollout`): prompts from a dataset (datasets/), completions or multi-turn episodes
(environments/) through the proxy with the newest live adapter version, rewards with TRL's signature, scored groups
written to the bucket as shards, pacing so that nothing is trained beyond max_staleness, and held-out evaluation.
No torch: it installs on a CPU box."""
