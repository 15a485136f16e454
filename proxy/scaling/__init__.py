"""How many replicas the run should have: the pure rule (desired.py), the signals it reads (a run's from its
bucket, bucket/pace.py; a shared pool's from its runs' reports, pool_signals.py), and the loop that looks every
`scale_interval_s`, exports the gauge and writes the event (autoscaler.py). See docs/autoscaling.md.

May import the top-level basics (state, config, event_writer); never adapters/, serving/ or pool/ (what it needs
of the hot path, the requests in flight and waiting, and of a pool, its runs' reports, reaches it as a callback
wired in app.py).
"""
