"""The trainer's side of the Tinker API: it executes a client's training operations from the bucket.

On a run whose run.json says `api = "tinker"`, `brigade trainer` runs `loop.run_tinker` instead of the GRPO loop.
The proxy (which serves the client's HTTP) writes each call as an object under tinker/models/<model_id>/
(bucket/tinker.py); the trainer holds one model at a time (`hold.py`: check it, give it a fresh or saved LoRA and a
fresh Adam), executes its operations in seq_id order (`session.py`) and writes one result per operation. The loss
of forward / forward_backward is trainer/losses.py's, on the same packed rows as GRPO's (`data.py` turns each
datum into a row's completion); weights for sampling are published as ordinary adapter versions. Every
optim_step / load_weights persists the weights and the optimizer (`state.py`) before its result, so a restarted
trainer resumes where the last one was and applies each operation once.
"""
