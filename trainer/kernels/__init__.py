"""The trainer step's fused GPU paths, each used only where its assumptions hold (the general path is exact
elsewhere): tree attention over a packed row, flash-attn-4 where installed, the LM head's log-probabilities,
concatenated projections, and the SwiGLU MLP with its rank-1 LoRA terms as one op."""
