"""ZeroMQ transport for Prism (filled in by the foundation issue)."""
