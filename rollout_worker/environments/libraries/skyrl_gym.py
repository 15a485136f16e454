"""`--rollout.environment skyrl-gym:ENV-ID`: a skyrl-gym environment, unchanged, as a text-step environment.

reset(**row)   skyrl_gym.make(ENV-ID, env_config=row's `env_config` (an OmegaConf config, empty by default),
               extras={"reward_spec": row's `reward_spec`, else {"method": "rule", "ground_truth": row's
               `ground_truth`, else its `answer`}, "extra_info": row's `extra_info`, else {}}), then
               env.init(row's prompt as chat messages); what init appended to the last user message is the
               observation (a rewritten prompt is refused: the row's prompt is what the model is shown)
step(reply)    env.step(reply) -> {"observations", "reward", "done", "metadata"}: the observations' contents (a
               blank line apart) become the next user message, the step's reward adds to the episode's, `done`
               ends it; `postprocessed_action` is not applied (the sample keeps the tokens the model sampled)
close()        env.close(), when the episode ends
"""

from __future__ import annotations

from typing import Any

from rollout_worker.environments.libraries.common import messages_text
from rollout_worker.environments.schema import EnvSpecError


def _import() -> Any:
    try:
        import skyrl_gym
    except ImportError as exc:
        from rollout_worker.environments.libraries import missing_library

        raise missing_library("skyrl-gym", exc) from None
    return skyrl_gym


def reward_spec(row: dict[str, Any]) -> dict[str, Any]:
    """skyrl's `reward_spec` for the row: its own column, else the ground truth from `ground_truth` or `answer`."""
    spec = row.get("reward_spec")
    if isinstance(spec, dict):
        return spec
    truth = row.get("ground_truth", row.get("answer"))
    if truth is None:
        raise ValueError(
            "skyrl-gym scores against the row's ground truth: give the dataset a ground_truth (or answer, or skyrl's "
            f"reward_spec) column; this row has {sorted(row)}"
        )
    return {"method": "rule", "ground_truth": truth if isinstance(truth, (str, list, dict)) else str(truth)}


def _as_messages(prompt: Any) -> list[dict[str, Any]]:
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


class SkyRLGymEnv:
    """One episode of a skyrl-gym environment, through brigade's text-step contract."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id
        self.sg = _import()
        self.env: Any = None

    @classmethod
    async def check(cls, env_id: str) -> None:
        sg = _import()
        known = sorted(sg.registry)
        if env_id not in known:
            raise EnvSpecError(f"skyrl-gym has no environment {env_id!r}; its environments: {', '.join(known)}")

    def reset(self, **row: Any) -> str:
        from omegaconf import OmegaConf  # skyrl-gym's own dependency: its environments read env_config as one

        extras = {"reward_spec": reward_spec(row), "extra_info": row.get("extra_info") or {}}
        config = OmegaConf.create(row.get("env_config") or {})
        self.env = self.sg.make(self.env_id, env_config=config, extras=extras)
        prompt = _as_messages(row.get("prompt", ""))
        messages, _info = self.env.init([dict(m) for m in prompt])
        return _appended(prompt, list(messages), self.env_id)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        out = self.env.step(action)
        reward = out.get("reward")
        return messages_text(out.get("observations")), float(reward or 0.0), bool(out.get("done")), {}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def _appended(prompt: list[dict[str, Any]], messages: list[dict[str, Any]], env_id: str) -> str:
    """What init added to the prompt's last message: "" when it returned the prompt as it was."""
    if messages == prompt:
        return ""
    same_head = len(messages) == len(prompt) and messages[:-1] == prompt[:-1]
    before, after = str(prompt[-1].get("content", "")), str(messages[-1].get("content", "")) if messages else ""
    if same_head and messages[-1].get("role") == prompt[-1].get("role") and after.startswith(before):
        return after[len(before) :]
    raise ValueError(
        f"skyrl-gym's {env_id} init() rewrote the prompt ({len(prompt)} messages in, {len(messages)} out); brigade "
        "shows the model the row's prompt and appends to its last message only: put the prompt in the dataset"
    )
