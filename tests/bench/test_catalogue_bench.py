"""benchmarks/catalogue_bench.py's report section: every number it prints is one the results JSON holds, and
the verdict row is the recorded one."""

from __future__ import annotations

from benchmarks import catalogue_bench, report

from bench.support import PROVENANCE, _iqr, _unexplained

RESULT = {
    "settings": {"images": 4000, "rounds": 3, "backbone": "tf_efficientnet_lite0", "embedding_dim": 512,
                 "image_size": 64, "shard_size": 1000, "threads_total": 2, "chunk_size": 1024, "batch_size": 64},
    "images": 4000,
    "rounds": [{"order": ["single_1", "single_2", "dask_1", "dask_2"], "loadavg_before": [1.23, 1.1, 1.0],
                "single_1": 151.2, "single_2": 287.4, "dask_1": 146.9, "dask_2": 271.3}],
    "images_per_s": {"single_1": _iqr(151.2, 149.8, 153.1), "single_2": _iqr(287.4, 281.7, 290.2),
                     "dask_1": _iqr(146.9, 145.3, 148.8), "dask_2": _iqr(271.3, 266.6, 275.9)},
    "dask_over_single": _iqr(0.9439, 0.9317, 0.9561) | {"per_round": [0.9439]},
    "scaling_efficiency": {"1": _iqr(0.9715, 0.9613, 0.9802), "2": _iqr(0.8972, 0.8851, 0.9093)},
    "target_at_least": 0.9,
    "verdict": "met",
    "provenance": PROVENANCE | {"command": "python -m benchmarks catalogue"},
    "_file": "benchmarks/results/catalogue.json",
}


def test_the_section_prints_only_json_numbers_and_the_recorded_verdict():
    text, targets = catalogue_bench.render(RESULT)
    assert _unexplained(text, RESULT) == []
    assert "**0.9439**" in text and "2 worker(s) 0.8972" in text
    assert targets == [{"section": "catalogue", "what": "Dask embedding, 2 workers / one `xbn embed` process "
                        "with 2 threads, images/s >= 0.9", "value": 0.9439, "verdict": "met"}]
    assert report._header(RESULT)  # the provenance renders as every section's does
