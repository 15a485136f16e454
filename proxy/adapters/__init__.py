"""What the replicas hold: the lifecycle that decides it (lifecycle.py), all-or-nothing loads and unloads
fanned out to every replica (fanout.py), the served-policy probe (probe.py), client adapter folders imported
as versions (adapter_import.py), and the live versions written for the replicas' mirrors (live_writer.py).

May import replicas/ and the top-level basics (state, config, errors, event_writer, lora_paths); never
serving/ (the hot path is reached only through callbacks wired in app.py).
"""
