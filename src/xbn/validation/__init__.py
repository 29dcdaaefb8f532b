"""Data validation before training: a great-expectations suite over the manifest and its images.

`validate_manifest` returns a `ValidationResult` (JSON and Markdown reports); the `validate` stage raises
`ValidationFailed`, a `DatasetError`, when an expectation fails. great-expectations itself is imported only
when a suite runs, so importing this package stays cheap.
"""

from xbn.validation.result import ExpectationOutcome, ValidationFailed, ValidationResult
from xbn.validation.suite import PUBLISHED_COUNTS, validate_manifest, validate_manifest_file

__all__ = [
    "PUBLISHED_COUNTS",
    "ExpectationOutcome",
    "ValidationFailed",
    "ValidationResult",
    "validate_manifest",
    "validate_manifest_file",
]
