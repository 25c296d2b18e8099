"""The OpenAI-compatible HTTP frontend: a separate process, and just another ZMQ client of the
pipeline (one `BatonClient`), translating HTTP requests to it."""
