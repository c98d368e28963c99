"""Entry points into contbatch: the servers built on its public API."""
