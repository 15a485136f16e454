"""Benchmarks: each `python -m benchmarks.FOLDER.NAME --json` runs one measurement and prints one JSON object as its
last line, with the CPU (or GPU) it ran on. Speed goals live here, never in timed tests. The folders are concerns:
proxy/ (its cost per request, routing, prefill, the served-policy probe), trainer/ (the GRPO step, its GPU kernels
and the GPU measurement script), system/ (whole runs: chaos, long completions, the rollout side) and scaling/
(adapter sync, the autoscaler, a shared pool). Beside them the shared harness: report.py (the JSON line's CPU and
GPU naming, percentiles, keeping a record) and results/ (the records that back published figures). The flat
modules that only import a folder's `main` keep older commands (`python -m benchmarks.trainer_step`) working."""
