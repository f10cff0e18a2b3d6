"""The engine section of a release spec: which engine kind to build and its limits."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]


class EngineSpec(BaseModel):
    """Engine kind and build limits; the engine refuses requests beyond them."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["torch"] = Field("torch", description="Engine kind. `torch` runs everywhere (CPU and CUDA).")
    dtype: Dtype = Field("float32", description="Weight and activation dtype of the engine.")
    max_batch_size: int = Field(8, ge=1, le=1024, description="Most sequences the engine decodes at once.")
    max_input_len: int = Field(128, ge=1, description="Longest prompt, in tokens.")
    max_seq_len: int = Field(256, ge=2, description="Longest prompt + generated tokens, in tokens.")

    @model_validator(mode="after")
    def _input_fits_sequence(self) -> EngineSpec:
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"max_input_len ({self.max_input_len}) must be smaller than max_seq_len ({self.max_seq_len}) "
                "so that at least one token can be generated"
            )
        return self
