"""The OpenAI-compatible API of the router: `schemas` (the request bodies, unknown fields
refused), `validation` (reading and checking a body: 4xx that say what to change), `fields` (a
request's prompt, conversation, stop strings and logit bias), `guides` (the output constraint a
request asks for), `plans` (a request made into a Plan with its SamplingParams), `responses`
(answer and SSE chunk bodies) and `errors` (APIError)."""
