"""Memory-saving techniques, one module each: a frozen config and an ``apply``."""
