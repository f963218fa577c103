"""a2d stores."""
