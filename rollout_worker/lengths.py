"""Token lengths sized to the run's task, filled in where the user set none.

One limit cannot serve every task: the built-in sums answer in a few tokens (16 leaves room, and a longer limit
only lets the 135M model ramble on a 2-core CPU), while reasoning needs room to work and a tool call needs room
for its JSON. So the [rollout] lengths a user did not give (by flag, TOML file or override) follow the data:

    the built-in sums ('arithmetic')        16 per completion, 32 per evaluation answer
    any other dataset (reasoning-gym, a     256 per completion (TRL's default max_completion_length): room
      file, a hub dataset, gsm8k)            to reason before the answer
    an environment (--rollout.environment)  256 per reply (a tool call and some reasoning), 2048 per episode
                                             (the prompt with the tools' schemas and several turns)

An evaluation answer not given is as long as a training one (at least): a greedy answer cut shorter than the
answers the run trains would be judged wrong for its length alone.

A length the user gave is never changed; rollout_worker/length_check.py says, before the first step, when one
cannot hold a tool call or an answer. The trainer's dr_grpo denominator follows whatever was used: each group
records its limit (SamplingParams.max_tokens in the shard).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_worker.datasets.spec import is_reasoning_gym

if TYPE_CHECKING:  # rollout_worker.config imports this module: its validator fills the lengths
    from rollout_worker.config import RolloutConfig

ARITHMETIC = {"max_completion_length": 16, "eval_max_tokens": 32}
DATASET = {"max_completion_length": 256}
ENVIRONMENT = {"max_completion_length": 256, "max_episode_tokens": 2048}
# Every field a profile may set: the RolloutConfig defaults of the others stay as they are.
LENGTH_FIELDS = ("max_completion_length", "eval_max_tokens", "max_episode_tokens")


def profile(dataset: str, environment: str) -> dict[str, int]:
    """The lengths of a run of `dataset` (and `environment`, when set) that the user did not give."""
    if environment:
        return ENVIRONMENT
    if dataset == "arithmetic":
        return ARITHMETIC
    return DATASET


def kind(dataset: str, environment: str) -> str:
    """The profile's name, for messages."""
    if environment:
        return "an environment run"
    if dataset == "arithmetic":
        return "the built-in sums"
    return "a reasoning-gym run" if is_reasoning_gym(dataset) else "a dataset run"


def fill_lengths(settings: RolloutConfig) -> None:
    """Set the profile's lengths on a validated RolloutConfig, for the fields the user did not give.

    Written to the model's __dict__, not through setattr: pydantic would count an attribute set so as given,
    and a later step that keeps "what the user gave" (brigade local's task and CPU sizing) would keep these
    defaults as if they were the user's."""
    given = settings.model_fields_set
    lengths = profile(settings.dataset, settings.environment)
    for field, value in lengths.items():
        if field not in given and field != "eval_max_tokens":
            settings.__dict__[field] = value
    if "eval_max_tokens" not in given:
        settings.__dict__["eval_max_tokens"] = max(lengths.get("eval_max_tokens", 0), settings.max_completion_length)


def episode_limit(max_turns: int, max_completion_length: int, max_episode_tokens: int) -> int:
    """The most tokens an episode can sample (its trained tokens): every turn's reply at its limit, within the
    episode's stream (its prompt takes some of that, so this is an upper bound)."""
    return min(max_turns * max_completion_length, max_episode_tokens)


def sampled_limit(settings: RolloutConfig) -> int:
    """The most tokens one sample of this run can train: what the trainer's dr_grpo divides by by default."""
    if settings.environment:
        return episode_limit(settings.max_turns, settings.max_completion_length, settings.max_episode_tokens)
    return settings.max_completion_length


def fit_episodes(settings: RolloutConfig, max_model_len: int | None) -> str:
    """An episode bound the user did not give yields to the replicas' max_model_len (every turn's request holds
    the episode so far, and vLLM refuses one longer than that); a given one is kept (and refused by the length
    check if it cannot fit). Returns a line saying what changed ('' when nothing did)."""
    too_long = max_model_len is not None and settings.max_episode_tokens > max_model_len
    if not settings.environment or "max_episode_tokens" in settings.model_fields_set or not too_long:
        return ""
    settings.__dict__["max_episode_tokens"] = max_model_len
    return f"rollout.max_episode_tokens {max_model_len}: the replicas' max_model_len, which an episode must fit"
