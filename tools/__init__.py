"""Repository tools (not part of the library or its wheel)."""
