"""Errors raised by the registry package.

One base class, narrow subclasses. Every message names the offending value and, where there is
one, the setting it came from (the style of ``mlflow/exceptions.py``), so a failed release reads
as a report rather than a stack trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class RegistryError(Exception):
    """Base class of every error raised by ``registry``."""


class StoreConfigError(RegistryError):
    """An artifact store URI or S3 setting is missing or unusable."""


class ManifestError(RegistryError):
    """A manifest or an artifact key is malformed."""


@dataclass(frozen=True)
class FileMismatch:
    """One file whose content differs from what the manifest records."""

    path: str
    expected_sha256: str
    actual_sha256: str
    expected_size: int
    actual_size: int


class ChecksumMismatchError(RegistryError):
    """Files differ from their manifest: wrong checksum, missing, or not listed."""

    def __init__(
        self,
        location: str,
        *,
        mismatched: Sequence[FileMismatch] = (),
        missing: Sequence[str] = (),
        extra: Sequence[str] = (),
    ) -> None:
        self.location = location
        self.mismatched = tuple(mismatched)
        self.missing = tuple(missing)
        self.extra = tuple(extra)
        lines = [f"Artifact at '{location}' does not match its manifest:"]
        for m in self.mismatched:
            lines.append(
                f"  file '{m.path}': expected sha256 {m.expected_sha256} ({m.expected_size} bytes), "
                f"actual sha256 {m.actual_sha256} ({m.actual_size} bytes)"
            )
        lines += [f"  file '{p}': listed in the manifest but missing" for p in self.missing]
        lines += [f"  file '{p}': present but not listed in the manifest" for p in self.extra]
        super().__init__("\n".join(lines))


class ArtifactExistsError(RegistryError):
    """A complete artifact already exists under the key with different content."""

    def __init__(self, uri: str, *, differing: Sequence[str]) -> None:
        self.uri = uri
        self.differing = tuple(differing)
        shown = ", ".join(f"'{p}'" for p in self.differing[:10])
        more = f" and {len(self.differing) - 10} more" if len(self.differing) > 10 else ""
        super().__init__(
            f"A published artifact already exists at '{uri}' with different content "
            f"(differing files: {shown}{more}). Published artifacts are immutable: the key is the "
            "engine fingerprint, so different content under the same fingerprint means the "
            "fingerprint does not cover everything that went into the build."
        )


class IncompleteArtifactError(RegistryError):
    """The key has no manifest: the upload never finished (or never started)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        super().__init__(
            f"No manifest at '{uri}': the artifact is incomplete (its upload did not finish) or "
            "does not exist. Re-run the publish step to complete it."
        )


class UploadError(RegistryError):
    """A file did not land in the store intact; the manifest is not written."""


class ModelVersionNotFoundError(RegistryError):
    """A registered model version (or alias) does not exist."""


class ApprovalTimeoutError(RegistryError):
    """Nobody approved or rejected a model version within the allowed time."""

    def __init__(self, model_name: str, version: str, timeout_s: float, *, last_value: str | None) -> None:
        self.model_name = model_name
        self.version = version
        self.timeout_s = timeout_s
        self.last_value = last_value
        seen = f"'{last_value}'" if last_value is not None else "not set"
        super().__init__(
            f"No approval decision for model '{model_name}' version {version} within {timeout_s:g} s "
            f"(setting approval.timeout_s); the version tag 'approval' was {seen}. Set it to "
            "'approved' or 'rejected' in the MLflow UI, then re-run."
        )


class ApprovalNotAuthorizedError(RegistryError):
    """An approval exists but cannot be shown to come from an approver other than the publisher."""
