"""Prompt-and-reward sources beyond prompts.py's files (reasoning-gym's procedural tasks: docs/environments.md),
and how any dataset is split into training rows and the held-out set.

split.py          the held-out split, by row (a repeated prompt with a seed column trains and evaluates)
errors.py         DataError: a dataset that cannot be used, named, with what to do

spec.py           `--rollout.dataset reasoning-gym:TASK[:OPTIONS][+TASK...]` parsed into typed task specs
extraction.py     the answer a reply gives, by a named rule (number, <answer> tags, last line, whole reply)
entry_codec.py    a task entry as JSON text and back, exactly (tuples and sets survive)
reasoning_gym.py  the training stream, the held-out set, the curriculum's levels, and the reward that calls
                  the task's own score_answer
"""
