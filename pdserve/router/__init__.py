"""The router: OpenAI HTTP API in front, placement of every request on the worker pools."""
