"""The version of specmoe, written here only (pyproject.toml reads it; ``specmoe --version``
and ``specmoe.__version__`` print it)."""
__version__ = "0.2.0"
