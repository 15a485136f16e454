"""Multi-turn episodes from environments users already write (--rollout.environment; docs/environments.md).

  contract.py    the two contracts (TRL's environment_factory, text-step), told apart by `step`
  schema.py      a tool's JSON schema from its type hints and Google-style docstring
  tool_calls/    a reply's tool calls in the model's own format (hermes, llama3_json, mistral, qwen3_coder),
                 the format its template teaches (detect.py), the tool list for templates that ignore `tools`
  host.py        each episode's instance in a process of its own, calls with a timeout
  stream.py      one token stream per episode: sampled ids plus template differences from /tokenize
  episode.py     one episode's turns; groups.py: a row's episodes as one scored group
  episode_rewards.py  an episode's reward (the environment's plus the reward functions), for both of these
  held_out.py    the held-out evaluation of an environment run: one greedy episode per row, judged by its reward

Nothing is imported here: an environment's process imports only host.py and contract.py.
"""
