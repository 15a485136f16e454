"""Benchmarks: each `python -m benchmarks.NAME --json` runs one measurement and prints one JSON object as its last
line, with the CPU (or GPU) it ran on (benchmarks/report.py). Speed goals live here, never in timed tests.
Proxy (proxy_overhead, routing, prefill, multiturn), trainer (trainer_step and its shapes, kernels and GPU script
trainer_gpu.sh), system (learning, chaos, long_tail, local_run) and scaling (sync_*, autoscale*, shared_pool*)."""
