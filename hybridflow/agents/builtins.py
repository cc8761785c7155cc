"""The built-in tools, tool-call formats and environments; importing this module registers them."""

