"""Spec sections of the promotion: approval, Triton targets and the rollout plan (Argo's vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ApprovalSpec(BaseModel):
    """How a published version is approved before it reaches Triton."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "mlflow-tag"] = Field(
        "mlflow-tag",
        description="`mlflow-tag`: wait until a person sets the version tag `approval` to `approved` or "
        "`rejected` in the MLflow UI. `auto`: approve at once (demos, tests).",
    )
    timeout_s: float = Field(3600, gt=0, description="How long to wait for a decision before giving up.")
    poll_s: float = Field(5, gt=0, description="Seconds between two reads of the approval tag.")
    ui_url: str | None = Field(
        None, description="Base URL of the MLflow UI for the approval link; default: the tracking URI if HTTP."
    )


class TritonEndpoint(BaseModel):
    """A running Triton server and the model repository it serves (explicit model-control mode)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="HTTP URL of the server, e.g. http://127.0.0.1:8000.")
    model_repository: Path = Field(description="Local path of the model repository that server reads.")

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Triton URL {url!r} must start with http:// or https://")
        return url.rstrip("/")


class TritonSpec(BaseModel):
    """Where the engine is served; no endpoints means the bundled Triton started on loopback."""

    model_config = ConfigDict(extra="forbid")

    endpoints: list[TritonEndpoint] = Field(
        default_factory=list,
        description="Servers to promote into, as one fleet. Empty: start the tritonserver bundled in the "
        "nvidia-pytriton wheel on 127.0.0.1 over `model_repository`.",
    )
    model_repository: Path = Field(
        Path(".state/triton-repository"), description="Model repository of the embedded server."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the llm model runs: KIND_GPU when CUDA is present (auto) or forced."
    )
    max_queue_size: int = Field(64, ge=1, description="Requests queued per model before Triton rejects more.")
    max_queue_delay_us: int = Field(2000, ge=0, description="Dynamic batching: longest wait to fill a batch.")
    load_timeout_s: float = Field(120, gt=0, description="Longest wait for a model to load.")
    request_timeout_s: float = Field(60, gt=0, description="Client timeout of one inference request.")


class SetWeight(BaseModel):
    model_config = ConfigDict(extra="forbid")
    set_weight: int = Field(ge=0, le=100, description="Percent of traffic routed to the candidate version.")


class PauseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    duration_s: float = Field(ge=0, description="Seconds to hold the current weight while traffic flows.")


class Pause(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pause: PauseSpec


class AnalysisSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: int = Field(20, ge=1, description="Requests sent through the router in this analysis.")
    min_success_rate: float = Field(1.0, ge=0, le=1, description="Least fraction of successful requests.")
    max_new_tokens: int = Field(8, ge=1, description="Tokens generated per analysis request.")


class Analysis(BaseModel):
    model_config = ConfigDict(extra="forbid")
    analysis: AnalysisSpec


RolloutStep = Annotated[Union[SetWeight, Pause, Analysis], Field(union_mode="left_to_right")]


def _default_steps() -> list[RolloutStep]:
    return [
        SetWeight(set_weight=10),
        Analysis(analysis=AnalysisSpec()),
        SetWeight(set_weight=50),
        Analysis(analysis=AnalysisSpec()),
        SetWeight(set_weight=100),
        Analysis(analysis=AnalysisSpec()),
    ]


class RolloutSpec(BaseModel):
    """The gray release plan: steps in Argo Rollouts' vocabulary, applied to every endpoint."""

    model_config = ConfigDict(extra="forbid")

    steps: list[RolloutStep] = Field(default_factory=_default_steps, description="set_weight / pause / analysis.")
    concurrency: int = Field(2, ge=1, le=64, description="Parallel clients sending traffic during analysis.")

    @model_validator(mode="after")
    def _ends_at_full_weight(self) -> RolloutSpec:
        weights = [s.set_weight for s in self.steps if isinstance(s, SetWeight)]
        if not weights or weights[-1] != 100:
            raise ValueError(f"the last set_weight step must be 100 (got weights {weights})")
        return self
