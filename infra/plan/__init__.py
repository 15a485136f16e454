"""The capacity planner behind `brigade plan`: GPUs, KV cache and replica flags from a model's config.json.

  arch.py     the model's architecture from config.json: parameters, LoRA shapes, KV per token
  sizing.py   the formulas: weights, training state, KV per rollout, rollouts that fit, sync cost
  split.py    the recommended split (replicas x tensor-parallel size, trainer GPUs) or what fits instead
  report.py   the plan's figures as a table and as JSON
  main.py     the command: options, the run config that carries the plan, --out

Nothing here imports torch: a run is planned on a laptop. See docs/plan.md.
"""

from infra.plan.arch import ModelArch, PlanError, arch_from_config, load_arch
from infra.plan.main import DESCRIPTION, PlanOptions, main, make_plan
from infra.plan.report import Plan, figures, to_json
from infra.plan.sizing import RunShape
from infra.plan.split import Hardware, Split, split

__all__ = [
    "DESCRIPTION",
    "Hardware",
    "ModelArch",
    "Plan",
    "PlanError",
    "PlanOptions",
    "RunShape",
    "Split",
    "arch_from_config",
    "figures",
    "load_arch",
    "main",
    "make_plan",
    "split",
    "to_json",
]
