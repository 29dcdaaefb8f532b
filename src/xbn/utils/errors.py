"""Exceptions the CLI maps to exit codes without importing the heavy modules that raise them."""


class ServiceUnavailableError(ConnectionError):
    """A service the run needs (the MLflow tracking store) cannot be reached; the message names it."""
