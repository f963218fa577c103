"""a2d flows."""
