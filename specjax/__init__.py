"""specjax: exact speculative sampling in JAX/XLA."""

__version__ = "0.1.0"
