"""The built-in tools, tool-call formats and environments; importing this module registers them."""

from hybridflow.agents import (
    adapters,  # noqa: F401 (registers the "skyrl" and "trl" environments)
    environments,  # noqa: F401 (registers the "guess_number" environment)
    openai_agent,  # noqa: F401 (registers the "openai_agent" environment)
)
