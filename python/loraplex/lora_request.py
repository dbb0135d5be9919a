"""vLLM's LoRARequest (vllm.lora.request.LoRARequest)."""

from __future__ import annotations

import os
from typing import Optional


class LoRARequest:
    """A PEFT LoRA adapter on disk, as vLLM names it: lora_name (equality and hashing, as in
    vLLM), lora_int_id (>= 1; 0 means the base model) and lora_path (a local directory with
    adapter_config.json and adapter_model.safetensors)."""

    __slots__ = ("lora_name", "lora_int_id", "lora_path", "base_model_name", "load_inplace")

    def __init__(
        self,
        lora_name: str,
        lora_int_id: int,
        lora_path: str = "",
        lora_local_path: Optional[str] = None,
        long_lora_max_len: Optional[int] = None,
        base_model_name: Optional[str] = None,
        tensorizer_config_dict: Optional[dict] = None,
        load_inplace: bool = False,
    ) -> None:
        if lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {lora_int_id}")
        path = lora_path or lora_local_path or ""
        if not path:
            raise ValueError("lora_path cannot be empty")
        if long_lora_max_len is not None:
            raise ValueError("long_lora_max_len is not supported (vLLM removed long-context LoRA)")
        if tensorizer_config_dict is not None:
            raise ValueError("tensorizer adapters are not supported (safetensors only)")
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.lora_path = os.path.expanduser(path)
        self.base_model_name = base_model_name
        self.load_inplace = load_inplace

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return (
            f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, "
            f"lora_path={self.lora_path!r})"
        )
