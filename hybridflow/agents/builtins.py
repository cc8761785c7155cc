"""The built-in tools, tool-call formats and environments; importing this module registers them."""

import hybridflow.agents.formats
import hybridflow.agents.retrieval
import hybridflow.agents.sandbox
import hybridflow.agents.tool_env
import hybridflow.agents.tools  # noqa: F401
