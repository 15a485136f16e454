"""The generation hot path: the proxy's own HTTP server (httpserver.py), the answer written to the client
(raw_sink.py), the forwarder (forwarding.py), body parsing (generation_body.py), and the keep-alive
connections to the replicas (pool.py, over replicas/wire.py); beside it, the requests that are not
generations (passthrough.py).

May import replicas/, routing/ and the top-level basics (state, config, errors, lora_paths); never adapters/
(adapter loads reach the forwarder only as callbacks wired in app.py). pyproject.toml's import-linter contract
"Inside the proxy" checks this.
"""
