"""Version of the ``nccl_ep`` Python package (not of the C library it loads)."""

__version__ = "0.1.0"
