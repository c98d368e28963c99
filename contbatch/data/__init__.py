"""Shipped data (the GSM8K test set and its licence), prompt loading, and the embedded-model loader."""
