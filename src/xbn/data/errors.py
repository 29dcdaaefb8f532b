"""The one exception type for bad dataset input (label files, manifests, images)."""


class DatasetError(ValueError):
    """A dataset file or image that cannot be used; its message names the file, line or row, and key."""
