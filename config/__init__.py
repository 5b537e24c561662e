"""callgate config."""
