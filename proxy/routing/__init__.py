"""Prefix-aware routing: which replica a generation goes to (router.py), from chained block hashes of its
prompt (prefix_hashes.py), where those blocks live (prefix_links.py), the groups in flight (groups.py), each
episode's replica (sessions.py) and what each replica carries (loads.py). Pure computation, no I/O: imports
nothing of the proxy outside this folder.
"""
