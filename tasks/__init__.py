"""a2d tasks."""
