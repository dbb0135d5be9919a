"""vLLM's module layout (vllm.lora.request), so that imports only change their package name."""
