"""LoRARequest: which adapter a request uses (vLLM's fields and checks)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    # vLLM identifies adapters by their int id: two requests with the same id are the
    # same adapter, whatever else they say.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)
