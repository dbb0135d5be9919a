"""`from loraplex.lora.request import LoRARequest`, as `from vllm.lora.request import ...`."""

from loraplex.lora_request import LoRARequest

__all__ = ["LoRARequest"]
