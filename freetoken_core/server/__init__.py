"""``freetoken serve``: the OpenAI-compatible HTTP server and its engine process."""
