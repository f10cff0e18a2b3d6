"""MLflow tracking + model registry, approvals, artifact stores and manifests.

Modules: ``manifest`` (sha256 per file), ``stores`` (``file://`` and ``s3://``), ``tracking``
(release runs), ``model_registry`` (versions, fingerprints, aliases), ``approval`` (the human
gate), ``embedded`` (sqlite + local folders default), ``errors``. Never imports serving, tasks
or flows. Nothing is imported here so that ``import registry.manifest`` stays cheap.
"""
