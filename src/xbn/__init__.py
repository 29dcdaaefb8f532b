"""xbn: drift-corrected cross-batch memory for deep metric learning."""

from importlib import metadata

try:
    __version__ = metadata.version("xbn")  # pyproject.toml's, the one place it is written
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
