"""Running processes: the router (OpenAI HTTP API, placement) and workers (one engine each)."""
