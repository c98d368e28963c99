"""`contbatch serve`: an OpenAI-compatible HTTP server on a `ContinuousBatchingManager`."""
