"""A shared replica pool (issue 20, docs/pool.md): several runs attach to one proxy and its replicas.

access.py: tokens and what each caller may name (the generation gate); runs.py: admission against the
replicas' adapter slots, leases, detach, each run's live window; push.py: a run's adapter versions
committed in the pool's bucket and loaded everywhere; service.py: the parts together, and the
load/unload/live_adapters answers of a pool; http.py: the /pool/runs/... routes.
"""
