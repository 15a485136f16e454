"""Benchmarks of whole runs, every job a real process: held-out accuracy before and after a `brigade local` run
of a task (learning), a short `brigade local` run's throughput and sync
(local_run), the rollout side keeping real replicas busy (rollout), every job killed and restarted against a
faulty S3 and audited from the bucket (chaos), and long completions against the staleness window (long_tail,
seeded and simulated)."""
