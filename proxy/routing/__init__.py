"""Prefix-aware routing: which replica a generation goes to (router.py), from chained block hashes of its
prompt (prefix_hashes.py). Pure computation, no I/O: imports nothing of the proxy outside this folder.
"""
