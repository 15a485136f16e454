"""Prompt-and-reward sources beyond prompts.py's files: reasoning-gym's procedural tasks (docs/environments.md).

spec.py           `--rollout.dataset reasoning-gym:TASK[:OPTIONS][+TASK...]` parsed into typed task specs
extraction.py     the answer a reply gives, by a named rule (number, <answer> tags, last line, whole reply)
entry_codec.py    a task entry as JSON text and back, exactly (tuples and sets survive)
reasoning_gym.py  the training stream, the held-out set, the curriculum's levels, and the reward that calls
                  the task's own score_answer
"""
