"""callgate bench."""
