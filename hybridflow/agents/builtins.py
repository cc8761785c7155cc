"""The built-in tools, tool-call formats and environments; importing this module registers them."""

from hybridflow.agents import (
    environments,  # noqa: F401 (registers the "guess_number" environment)
    external_envs,  # noqa: F401 (registers the "skyrl" and "trl" environments)
    formats,  # noqa: F401 (registers the "hermes" and "compact" tool-call formats)
    openai_agent,  # noqa: F401 (registers the "openai_agent" environment)
    retrieval,  # noqa: F401 (registers the "retrieval" tool)
    sandbox,  # noqa: F401 (registers the "python" tool)
    tool_env,  # noqa: F401 (registers the "tools" and "calculator" environments)
    tools,  # noqa: F401 (registers the "calculator" tool)
)
