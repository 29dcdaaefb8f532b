"""benchmarks/serving_bench.py: how its intervals and verdicts are derived (no timing). A p99's interval comes
from the order statistics, nprobe is the smallest reaching the recall, a target with several conditions is met
only when all are, and the report section prints only numbers its JSON holds."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from benchmarks import report, serving_bench
from benchmarks.serving_bench import choose_nprobe, combine, quantile_interval

from bench.support import PROVENANCE, _p99, _unexplained


def test_median_interval_from_the_binomial_by_hand():
    # B ~ Bin(100, 0.5): P(B <= 39) = 0.0176 < 0.025 <= P(B <= 40) = 0.0284, so l = 40;
    # P(B <= 59) = 0.9716 < 0.975 <= P(B <= 60) = 0.9824, so u = 60 + 1 = 61. Values 1..100: x_(r) = r.
    values = np.random.default_rng(0).permutation(np.arange(1, 101))
    got = quantile_interval(values, 0.5)
    assert got == {"value": 50.5, "low": 40.0, "high": 61.0, "ranks": [40, 61], "n": 100, "clipped": False}


def test_p99_of_few_requests_is_clipped_to_the_largest():
    # n = 300, q = 0.99: the 97.5% point of Bin(300, 0.99) is 300, so u = 301 > n: the upper end is the max
    got = quantile_interval(np.arange(1, 301), 0.99)
    assert got["high"] == 300.0 and got["clipped"] and got["ranks"][1] == 300
    assert got["low"] <= got["value"] <= got["high"]
    with pytest.raises(ValueError, match="at least one"):
        quantile_interval([], 0.99)


def test_nprobe_is_the_smallest_reaching_the_recall():
    curve = [{"nprobe": 1, "recall": 0.83}, {"nprobe": 2, "recall": 0.94}, {"nprobe": 4, "recall": 0.998}]
    assert choose_nprobe(curve, 0.95) == 4 and choose_nprobe(curve, 0.94) == 2
    assert choose_nprobe(curve, 0.999) is None


def test_combine_needs_every_condition():
    assert combine("met", "met") == "met"
    assert combine("met", "inconclusive") == "inconclusive"
    assert combine("inconclusive", "missed") == "missed" and combine("met", "missed") == "missed"


SERVING = {
    "settings": {"concurrency": 8, "pq_m": 64},
    "search": {"rows": 100000, "dim": 512, "type": "ivf_flat", "build_s": 31.5, "k": 10, "nlist": 1264,
               "curve": [{"nprobe": 1, "recall": 0.8343}, {"nprobe": 2, "recall": 0.9577}], "nprobe": 2,
               "reached_on_tuning": True, "recall_check": 0.9611, "upload_bytes": 69, "decode_us_median": 41.3,
               "server_neighbours_ms": _p99(1.1, 2.9), "http_sequential_ms": _p99(12.5, 17.25),
               "http_concurrent_ms": _p99(40.5, 55.75), "concurrency": 8, "concurrent_requests": 400,
               "throughput_rps": 211.7},
    "ivf_pq": {"rows": 1000000, "dim": 512, "pq_m": 64, "pq_nbits": 8, "build_s": 190.2, "k": 10, "nlist": 1000,
               "curve": [{"nprobe": 8, "recall": 0.8123}, {"nprobe": 16, "recall": 0.9213}], "nprobe": 16,
               "reached_on_tuning": True, "refine": "fp16", "k_factor": 8,
               "k_factor_ladder": [{"k_factor": 1, "recall": 0.6163}, {"k_factor": 2, "recall": 0.729},
                                   {"k_factor": 4, "recall": 0.8317}, {"k_factor": 8, "recall": 0.921}],
               "recall_check": 0.9187, "flat_ms": _p99(150.0, 190.0),
               "ivfpq_ms": _p99(3.0, 4.0), "flat_over_ivfpq": {"median": 47.3, "p25": 41.2, "p75": 52.8, "n": 40}},
    "onnx": {"backbone": "tf_efficientnet_lite0", "image_size": 224, "embedding_dim": 512, "threads": 2,
             "onnxruntime": "1.32.0",
             "rows": [{"batch": 1, "rounds": 30, "max_abs_diff": 2.1e-6, "torch_images_per_s": 31.7,
                       "onnx_images_per_s": 77.4, "onnx_over_torch": {"median": 2.44, "p25": 2.31, "p75": 2.6,
                                                                      "n": 30}},
                      {"batch": 64, "rounds": 6, "max_abs_diff": 3.4e-6, "torch_images_per_s": 41.9,
                       "onnx_images_per_s": 40.3, "onnx_over_torch": {"median": 0.97, "p25": 0.93, "p75": 1.04,
                                                                      "n": 6}}]},
    "provenance": PROVENANCE | {"command": "python -m benchmarks serving"},
}


def test_targets_read_the_whole_interval_and_every_recall():
    # p99 [12.5, 17.25] <= 50 at recall 0.9611; 47.3 [41.2, 52.8] >= 10 at recall 0.9187; ONNX / torch at most
    # 1.25 (torch >= 0.8x ONNX): batch 1 [2.31, 2.6] is above it, batch 64 [0.93, 1.04] below
    assert [t["verdict"] for t in serving_bench.targets(SERVING)] == ["met", "met", "missed", "met"]
    straddles = copy.deepcopy(SERVING)
    straddles["onnx"]["rows"][1]["onnx_over_torch"] |= {"p25": 1.1, "p75": 1.4}
    assert serving_bench.targets(straddles)[3]["verdict"] == "inconclusive"

    slow = copy.deepcopy(SERVING)
    slow["search"]["http_sequential_ms"] = _p99(45.0, 61.0)  # straddles 50 ms
    slow["ivf_pq"]["recall_check"] = 0.85  # 47x faster, but below 0.9 recall@10
    t = serving_bench.targets(slow)
    assert [t[0]["verdict"], t[1]["verdict"]] == ["inconclusive", "missed"]
    slow["search"]["recall_check"] = 0.94
    assert serving_bench.targets(slow)[0]["verdict"] == "missed"


def test_report_section_prints_only_json_numbers():
    data = copy.deepcopy(SERVING) | {"_file": "benchmarks/results/serving.json"}
    text, found = report.serving_section(data)
    assert _unexplained(text, SERVING | {"targets": found, "constants": [0.95, 0.9, 50, 10, 1.25, 0.8, 40]}) == []
    assert "**211.7 requests/s**" in text and "**met**" in text and "**missed**" in text
    assert "2031-02-03T04:05:06+00:00" in text and {t["section"] for t in found} == {"serving"}


def test_a_pq_recall_that_stops_rising_short_of_the_target_is_said():
    data = copy.deepcopy(SERVING)
    assert "stops rising" not in serving_bench.render(data)
    data["ivf_pq"]["curve"] = [{"nprobe": 16, "recall": 0.641}, {"nprobe": 32, "recall": 0.6412}]
    assert "stops rising" not in serving_bench.render(data)  # re-ranked: the curve is the cells' bound
    for key in ("refine", "k_factor", "k_factor_ladder"):  # a result of plain PQ (before issue 28)
        del data["ivf_pq"][key]
    assert "stops rising" in serving_bench.render(data)


def test_a_re_ranked_pq_says_its_store_and_k_factor():
    text = serving_bench.render(SERVING)
    assert "re-ranked exactly from an fp16 store" in text and "k_factor 8 is the smallest" in text
    assert "1: 0.6163, 2: 0.729, 4: 0.8317, 8: 0.921" in text
    assert serving_bench.targets(SERVING)[1]["what"].endswith("nprobe 16, fp16 re-rank k_factor 8")


def test_xbn_serve_against_onnx_runtime_is_a_target_at_each_batch():
    data = copy.deepcopy(SERVING)
    data["onnx"] |= {"serve_engine": "float32, NCHW; engine onnxruntime (torch 52.0 img/s, onnxruntime 77.0 img/s, "
                                     "min cosine to torch float32 1.000000), chosen by auto: faster than torch",
                     "serve_rows": [
                         {"batch": 1, "rounds": 30, "max_abs_diff": 0.0, "engine": "onnxruntime",
                          "serve_images_per_s": 76.9, "onnx_images_per_s": 77.4,
                          "serve_over_onnx": {"median": 0.99, "p25": 0.97, "p75": 1.01, "n": 30}},
                         {"batch": 64, "rounds": 6, "max_abs_diff": 0.0, "engine": "onnxruntime",
                          "serve_images_per_s": 37.1, "onnx_images_per_s": 40.3,
                          "serve_over_onnx": {"median": 0.93, "p25": 0.9, "p75": 0.97, "n": 6}}]}
    found = serving_bench.targets(data)[4:]
    assert [t["verdict"] for t in found] == ["met", "inconclusive"]  # [0.97, 1.01] >= 0.95; [0.9, 0.97] straddles
    assert found[0]["what"] == "xbn serve (inference.engine: auto) / ONNX Runtime images/s, batch 1 >= 0.95"
    text = serving_bench.render(data)
    assert "**`xbn serve` vs ONNX Runtime**" in text and "| 64 | onnxruntime | 6 | 37.1 | 40.3 | 0.93 [0.9, 0.97]" in text
