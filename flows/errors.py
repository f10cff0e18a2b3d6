"""The errors a person fixes by changing an input: the CLI and the flow outcomes print their message, not a trace."""

from __future__ import annotations


def known_errors() -> tuple[type[BaseException], ...]:
    """Every error class whose message names the offending value and setting.

    Imported when asked for, so `enginewright --help` does not load torch or pydantic.
    """
    from flows.deploy import DeployError
    from flows.spec import SpecError
    from registry.errors import RegistryError
    from serving.engine.errors import EngineError
    from serving.triton.errors import ServingError
    from tasks.errors import StepError

    return (SpecError, StepError, RegistryError, EngineError, ServingError, DeployError)
