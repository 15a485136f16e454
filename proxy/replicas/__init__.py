"""Which replicas receive traffic (membership.py) and the proxy's HTTP calls to one replica (upstream.py).

May import the top-level basics (state, config, event_writer, lora_paths); never serving/ or adapters/ (what
membership must tell them, it is handed as callbacks at construction, in app.py).
"""
