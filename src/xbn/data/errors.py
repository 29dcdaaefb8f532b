"""The one exception type for bad dataset input (label files, manifests, images)."""


class DatasetError(ValueError):
    """A dataset file or image that cannot be used; the message names the file, the line or row and the key."""
