"""Learning from feedback while serving (docs/learning.md)."""
