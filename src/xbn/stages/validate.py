"""Stage `validate`: check the manifest and its images before training; a failure stops the pipeline.

Both reports are written on every run (`validate.report` as JSON for DVC and the tracking run,
`validate.report_text` as Markdown for a person), then `ValidationFailed` is raised if any expectation
failed, so the CLI exits non-zero and `train` never starts on broken data.
"""

from __future__ import annotations

import logging

from xbn.config import Params
from xbn.utils.io import write_json, write_text
from xbn.validation import ValidationFailed, validate_manifest_file

log = logging.getLogger(__name__)


def validate(params: Params) -> dict:
    """Validate `data.manifest` (images under `data.root`); returns the report's summary when it passes."""
    d, v = params.data, params.validate
    result = validate_manifest_file(d.manifest, d.root, v, d.dataset)
    report = result.to_dict()
    write_json(v.report, report)
    write_text(v.report_text, result.to_markdown())
    if not result.success:
        raise ValidationFailed(result.failure_message(v.report_text), result)
    log.info("%s: %d expectations passed on %d rows -> %s", d.manifest, len(result.outcomes),
             result.summary["rows"], v.report)
    return {"success": True, **report["summary"], "report": v.report, "report_text": v.report_text}
