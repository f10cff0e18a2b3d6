"""The release spec: one YAML file (or Prefect form) describing a whole release, checked before any work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.engine_spec import EngineSpec
from tasks.gate_specs import EvaluationSpec, LmEvalGateSpec, PerfSpec, ServedSpec, ValidationSpec
from tasks.promote_spec import ApprovalSpec, RolloutSpec, TritonSpec


class SpecError(Exception):
    """The release spec cannot be used; the message names the field path and the bad value."""


class SourceSpec(BaseModel):
    """Where the Hugging Face checkpoint comes from."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Path = Field(description="Local folder of a Hugging Face checkpoint (config.json, *.safetensors).")


class MlflowSpec(BaseModel):
    """MLflow tracking and model registry."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str = Field(description="MLflow tracking URI: http(s):// server or sqlite:/// file.")
    model_name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Registered model name; also the Triton model name clients call.",
    )
    experiment: str = Field("enginewright", description="MLflow experiment of the release runs.")

    @field_validator("tracking_uri")
    @classmethod
    def _tracking(cls, uri: str) -> str:
        return check_tracking_uri(uri)


class ArtifactsSpec(BaseModel):
    """Where engine artifacts are published (content-addressed by engine fingerprint)."""

    model_config = ConfigDict(extra="forbid")

    uri: str = Field(description="`file:///abs/path`, `file://relative/path` (resolved against the directory "
                                 "the command runs in, when the spec is loaded) or `s3://bucket/prefix`.")

    @field_validator("uri")
    @classmethod
    def _scheme(cls, uri: str) -> str:
        return resolve_store_uri(uri)


def resolve_store_uri(uri: str) -> str:
    """``file://relative/path`` -> ``file:///abs/path`` (against the current directory); ``file:///abs`` and
    ``s3://bucket[/prefix]`` as they are; anything else a ValueError naming the URI."""
    if uri.startswith("s3://"):
        if not uri[len("s3://"):].split("/", 1)[0]:
            raise ValueError(f"artifact store URI {uri!r} names no bucket: s3://bucket/prefix")
        return uri
    if not uri.startswith("file://"):
        raise ValueError(f"artifact store URI {uri!r} must start with file:// or s3://")
    path = uri[len("file://"):]
    if path.startswith("localhost/"):
        path = path[len("localhost"):]
    if not path or path == ".":
        raise ValueError(f"artifact store URI {uri!r} names no folder")
    return Path(path).absolute().as_uri() if not path.startswith("/") else f"file://{path}"


TRACKING_SCHEMES = ("http", "https", "sqlite", "file", "postgresql", "mysql", "mssql", "databricks")


def check_tracking_uri(uri: str) -> str:
    """An MLflow tracking URI with a scheme MLflow serves and, for a server, a host; a ValueError otherwise."""
    scheme, sep, rest = uri.partition("://") if "://" in uri else uri.partition(":")
    base = scheme.split("+", 1)[0].lower()
    if not sep or base not in TRACKING_SCHEMES:
        raise ValueError(f"MLflow tracking URI {uri!r} must start with one of "
                         f"{', '.join(s + '://' for s in TRACKING_SCHEMES)}")
    if base in ("http", "https") and not rest.split("/", 1)[0]:
        raise ValueError(f"MLflow tracking URI {uri!r} names no host")
    if base == "sqlite" and not rest.lstrip("/"):
        raise ValueError(f"MLflow tracking URI {uri!r} names no database file: sqlite:///relative.db or "
                         "sqlite:////absolute.db")
    return uri


class ReleaseSpec(BaseModel):
    """Everything one release needs: source, engine, gates, records, targets and rollout."""

    model_config = ConfigDict(extra="forbid")

    source: SourceSpec
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine kind and build limits.")
    validation: ValidationSpec = Field(default_factory=ValidationSpec, description="Correctness gate.")
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec,
                                       description="Fixed evaluation against the production version.")
    lm_eval: LmEvalGateSpec = Field(default_factory=LmEvalGateSpec, description="Standard evals "
                                    "(lm-evaluation-harness tasks) against the production version, through Triton.")
    perf: PerfSpec = Field(default_factory=PerfSpec, description="Performance gate (A/B against production).")
    served: ServedSpec = Field(default_factory=ServedSpec, description="Drift of the served configuration (chat "
                               "template, stop ids, tokenizer) against production's: the intended differences.")
    mlflow: MlflowSpec
    artifacts: ArtifactsSpec
    approval: ApprovalSpec = Field(default_factory=ApprovalSpec, description="The human gate.")
    triton: TritonSpec = Field(default_factory=TritonSpec, description="Serving targets.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Gray release plan.")
    work_dir: Path = Field(Path(".state/work"), description="Scratch space for converted checkpoints and engines.")

    @property
    def model_name(self) -> str:
        return self.mlflow.model_name

    @model_validator(mode="after")
    def _held_needs_a_person(self) -> ReleaseSpec:
        holding = [f"{gate}.on_inconclusive" for gate, on in (("evaluation", self.evaluation.on_inconclusive),
                                                             ("perf", self.perf.on_inconclusive)) if on == "hold"]
        if holding and self.approval.mode == "auto":
            raise ValueError(f"{' and '.join(holding)} 'hold' publishes an undecided release for a person's review, "
                             "but approval.mode is 'auto' (nobody reviews): set approval.mode 'mlflow-tag' or "
                             "on_inconclusive 'refuse'")
        return self


def parse_spec(data: dict[str, Any], *, origin: str = "spec") -> ReleaseSpec:
    """Validate a spec mapping; errors list every bad field as a dotted path with its value."""
    try:
        return ReleaseSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_describe(exc, origin)) from None


def load_spec(path: Path) -> ReleaseSpec:
    """Read and validate a YAML release spec."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"release spec {str(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"release spec {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"release spec {str(path)!r} must be a mapping at the top level, got {type(data).__name__}")
    return parse_spec(data, origin=str(path))


def _describe(exc: ValidationError, origin: str) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        problems.append(f"{where}: {err['msg']}{value}")
    return f"release spec {origin} is invalid, nothing was done: " + "; ".join(problems)
