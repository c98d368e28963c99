"""Integrations with other tools; they use contbatch's public API only, never contbatch.engine."""
