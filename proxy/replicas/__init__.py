"""Which replicas receive traffic (membership.py; the adapters a joiner is given: handover.py), the proxy's HTTP
calls to one replica (upstream.py), and the keep-alive connections both those calls and the generation path
(serving/pool.py) go over (wire.py).

May import the top-level basics (state, config, event_writer, lora_paths); never serving/ or adapters/ (what
membership must tell them, it is handed as callbacks at construction, in app.py).
"""
