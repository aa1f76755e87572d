"""Stand-in for ai-toolkit's `toolkit` package (tests only; see ../README.md)."""
