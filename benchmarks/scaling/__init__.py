"""Benchmarks of brigade at scale: adapter sync latency, committed to loaded on every replica (sync_latency, on
real replicas idle or saturated, or with many simulated ones behind the real proxy), the autoscaler sizing
simulated replicas to the work (autoscale and its run, fleet, simulated replica and trainer, figures), and
several runs sharing one pool fairly and in isolation (shared_pool)."""
