"""The trainer's benchmarks: one GRPO step on synthetic groups of a model's shape (step, with its shapes, the
pre-packing reference step, the GPU knobs and liger candidates), a fused path's loss and gradients against the
trainer's own (fused_check), the GPU kernels alone (swiglu_kernel, flex_sweep), the profiled step's idle time
(gpu_timeline), the served-policy probe in bf16 (probe_gpu), and each model family's exact loss and gradients
against transformers with its adapter served by vLLM (model_families, on family_oracle's tiny models). gpu.sh runs
named sets of them on a GPU machine within one call's time limit; fa4_carry.sh packs flash-attn-4 for a machine
without network access."""
