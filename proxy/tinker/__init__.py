"""The Tinker API (the `tinker` SDK's service contract) on a run's proxy: sessions, sampling, and training calls
handed to the trainer through the bucket (bucket/tinker.py). docs/tinker.md is the user's guide."""
