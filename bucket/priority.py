"""Request priorities: which requests a replica runs first when several wait (one scale for every job).

vLLM's priority scheduling (`--scheduling-policy priority`, which every `brigade replica` starts with) orders
its waiting queue by the request field `priority`, lower first, then by arrival. A request without one is 0:
training generation and every client that sends none (TRL's trainer) keep first-come-first-served order
among themselves. The proxy sends a priority only to a replica that registered priority scheduling
(`ReplicaInfo.priority_scheduling`): any other refuses a priority but 0.
"""

from __future__ import annotations

CONTROL = -10  # the proxy's canary probe after a load: committed -> loaded waits on it, so it must not queue
GENERATION = 0  # training rollouts
EVALUATION = 10  # held-out evaluation: never ahead of the rollouts training waits for
