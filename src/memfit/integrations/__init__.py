"""Integrations of memfit plans with other training frameworks (Lightning, Hugging Face)."""
