"""`brigade dashboard`: a web page of a run, live from its bucket (read access is all it needs).

  data.py    what the page shows, read incrementally from the bucket (events, shards, checkpoints, registry)
  heartbeats.py  the replica registry and whose heartbeat moved, on this clock (both pages)
  health.py  the banner: is every version reaching every live replica fast, and if not who or what is at fault
  svg.py     charts as inline SVG drawn on the server: the page fetches nothing from anywhere
  page.py    the HTML
  server.py  the standard library's HTTP server and the thread that re-reads the bucket
  terminal.py  the same in a terminal (--terminal), with rich
  main.py    the command's flags
  pool_data.py, pool_page.py  `--pool`: a shared pool's runs side by side (its bucket, its proxy's /metrics)

Per-version sync stages come from `infra.timeline`. See docs/dashboard.md.
"""

from infra.dashboard.main import DESCRIPTION, main

__all__ = ["DESCRIPTION", "main"]
