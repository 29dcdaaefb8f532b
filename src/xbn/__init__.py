"""xbn: drift-corrected cross-batch memory for deep metric learning."""

__version__ = "0.1.0"
