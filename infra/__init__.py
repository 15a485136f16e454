"""Tools around the jobs, never imported by them: the `brigade` CLI (cli.py), `brigade local` (local*.py: every job
of a run as its own process on one machine), the run config composed of every job's table (config.py), summary,
eval, export, audit, the model builder, `brigade plan` (plan/), dashboards (dashboard/), monitoring rules
(monitoring/) and cluster launchers (launch/). It may import every job; nothing imports it."""
