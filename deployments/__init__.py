"""a2d deployments."""
