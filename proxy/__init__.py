"""The proxy job (`brigade proxy`): vLLM's OpenAI-compatible API in front of N replicas. It alone decides which
adapter versions the replicas hold (adapters/: all-or-nothing loads, the served-policy probe, unloads), routes each
generation to the replica holding its prefix (routing/, serving/), learns replicas from the bucket (replicas/),
publishes a desired replica count (scaling/) and serves several runs with per-run tokens as a pool (pool/).
app.py is the one wiring place. No torch."""
