"""`specsot serve`: the OpenAI-compatible HTTP API and the web chat, a client of the stage pipeline."""
