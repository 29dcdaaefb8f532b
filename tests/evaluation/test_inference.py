"""Inference mode (issue 28 items 1-2): each branch of the run-time choice forced on any CPU, the probe's
decision rule, and bfloat16's parity with float32 on real images through the ImageNet-pretrained backbone."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests_support import ROOT
from xbn.config import load_params
from xbn.evaluation import inference
from xbn.evaluation.inference import InferenceMode, choose_inference_mode, decide
from xbn.evaluation.knn import knn_search
from xbn.models import build_embedder
from xbn.serving.model import served

CPU = torch.device("cpu")
SIZE = 64


@pytest.fixture(scope="module")
def pretrained():
    """The shipped backbone (tf_efficientnet_lite0, offline ImageNet weights) with its head, and its config."""
    params = load_params(ROOT / "params.yaml", [f"data.image_size={SIZE}"])
    torch.manual_seed(0)
    model, data_config = build_embedder(params.model)
    return model.eval(), data_config


@pytest.fixture(scope="module")
def glyph_images(tmp_path_factory):
    from xbn.data.glyphs import generate_glyphs
    from xbn.serving.model import open_image

    root = tmp_path_factory.mktemp("inference") / "glyphs"
    generate_glyphs(root, classes=20, images_per_class=5, image_size=SIZE, seed=3)  # 100 images: bf16 is slow here
    return [open_image(p) for p in sorted(root.rglob("*.png"))]


def test_explicit_settings_are_taken_without_a_probe(monkeypatch, pretrained):
    monkeypatch.setattr(inference, "probe", lambda *a: pytest.fail("no probe for a forced mode"))
    model, _ = pretrained
    assert choose_inference_mode(model, CPU, SIZE, "bfloat16", True) == InferenceMode(True, True, "params")
    assert choose_inference_mode(model, CPU, SIZE, "float32", False) == InferenceMode(False, False, "params")


@pytest.mark.parametrize("forced", ["0", "1"])
def test_the_environment_forces_the_precision_on_any_cpu(monkeypatch, pretrained, forced):
    monkeypatch.setenv("XBN_CPU_BF16", forced)
    monkeypatch.setattr(inference, "_PROBES", {})
    model, _ = pretrained
    mode = choose_inference_mode(model, CPU, SIZE, "auto", False)  # one format: nothing left to probe
    assert mode.bf16 is (forced == "1") and mode.chosen_by == f"XBN_CPU_BF16={forced}"
    # auto format: float32 probes both formats; bf16 runs channels_last (NCHW bf16 is no candidate)
    mode = choose_inference_mode(model, CPU, SIZE, "auto", "auto")
    if forced == "1":
        assert mode == InferenceMode(True, True, "XBN_CPU_BF16=1") and not mode.rates
    else:
        assert not mode.bf16 and mode.chosen_by == "auto: probe"
        assert set(mode.rates) == {"contiguous_fp32", "channels_last_fp32"}


def test_without_native_bf16_auto_never_probes_bfloat16(monkeypatch, pretrained):
    monkeypatch.delenv("XBN_CPU_BF16", raising=False)
    monkeypatch.setattr(inference.cpu, "has_native_bf16", lambda: False)
    monkeypatch.setattr(inference, "_PROBES", {})
    mode = choose_inference_mode(pretrained[0], CPU, SIZE, "auto", "auto")
    assert not mode.bf16 and set(mode.rates) == {"contiguous_fp32", "channels_last_fp32"}


def test_with_native_bf16_auto_probes_and_logs_its_rates(monkeypatch, pretrained):
    monkeypatch.delenv("XBN_CPU_BF16", raising=False)
    monkeypatch.setattr(inference.cpu, "has_native_bf16", lambda: True)
    monkeypatch.setattr(inference, "_PROBES", {})
    mode = choose_inference_mode(pretrained[0], CPU, SIZE, "auto", "auto")
    # bf16 in NCHW is not a candidate when the format is free (see choose_inference_mode)
    assert set(mode.rates) == {"contiguous_fp32", "channels_last_fp32", "channels_last_bf16"}
    assert min(mode.rates.values()) > 0 and mode.record()["bf16"] == float(mode.bf16)
    assert choose_inference_mode(pretrained[0], CPU, SIZE, "auto", "auto") is mode  # cached: one probe


@pytest.mark.parametrize(("rates", "expected"), [
    # the H100's answer (benchmarks/results/gpu.json): bf16 channels_last 1.5-1.9x, bf16 NCHW 1.1-1.4x fp32
    ({"contiguous_bf16": 1700.0, "channels_last_bf16": 2900.0}, True),
    ({"contiguous_bf16": 2000.0, "channels_last_bf16": 2050.0}, False),  # within the format margin: NCHW
])
def test_on_cuda_auto_probes_both_formats_in_bfloat16(monkeypatch, pretrained, rates, expected):
    """The CUDA branch, on any machine: bf16 is taken without a probe, and bf16 NCHW is a candidate there
    (cuDNN has no slow bf16 NCHW path like oneDNN's), so the probe times both formats."""
    cuda = torch.device("cuda")
    seen = []

    def fake_probe(model, device, image_size, candidates):
        seen.append((device, image_size, candidates))
        return rates, None

    monkeypatch.setattr(inference, "probe", fake_probe)
    monkeypatch.setattr(inference, "_PROBES", {})
    mode = choose_inference_mode(pretrained[0], cuda, SIZE, "auto", "auto")
    assert seen == [(cuda, SIZE, ((False, True), (True, True)))]
    assert mode.bf16 and mode.channels_last is expected and mode.rates == rates
    assert choose_inference_mode(pretrained[0], cuda, SIZE, "auto", "auto") is mode and len(seen) == 1  # cached
    # an explicit format leaves one candidate: no probe
    assert choose_inference_mode(pretrained[0], cuda, SIZE, "auto", False) == InferenceMode(False, True, "auto: CUDA")
    assert len(seen) == 1


@pytest.mark.parametrize(("rates", "expected"), [
    # bf16 must beat the best float32 by 1.2x, channels_last the contiguous format by 1.05x
    ({"contiguous_fp32": 100, "channels_last_fp32": 150, "channels_last_bf16": 170}, (True, False)),
    ({"contiguous_fp32": 100, "channels_last_fp32": 150, "channels_last_bf16": 190}, (True, True)),
    ({"contiguous_fp32": 100, "channels_last_fp32": 104, "channels_last_bf16": 110}, (False, False)),
])
def test_decide_keeps_the_margins(rates, expected):
    candidates = ((False, False), (True, False), (True, True))
    mode = decide({k: float(v) for k, v in rates.items()}, candidates)
    assert (mode.channels_last, mode.bf16) == expected


def _parity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(lowest cosine between rows, share of leave-one-out top-1 neighbours that agree)."""
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    top_a = knn_search(a, a, 1, exclude_self=True)[1][:, 0]
    top_b = knn_search(b, b, 1, exclude_self=True)[1][:, 0]
    return float(cosine.min()), float((top_a == top_b).mean())


def test_forced_bfloat16_runs_in_bfloat16(pretrained, glyph_images):
    model, data_config = pretrained
    fp32 = served(model, data_config, SIZE, precision="float32", channels_last=False).embed_images(glyph_images)
    forced = served(model, data_config, SIZE, precision="bfloat16", channels_last=True)
    assert forced.mode.bf16 and forced.mode.channels_last and forced.mode.chosen_by == "params"
    b = forced.embed_images(glyph_images)
    assert b.dtype == np.float32 and np.abs(fp32 - b).max() > 1e-4  # bf16 did run: the results differ
    assert forced.mode.bf16  # forced by params: never taken back
    served(model, data_config, SIZE, precision="float32", channels_last=False)  # the shared model back in NCHW


@pytest.mark.parametrize("bar", [0.999, 0.9])
def test_what_auto_chooses_keeps_parity_with_float32(monkeypatch, pretrained, glyph_images, bar):
    """Issue 28 item 2: auto's embeddings keep cosine >= 0.999 to float32 and the top-1 neighbour on >= 99% of
    queries. The probe's synthetic images can pass bf16 at 64 px, glyphs do not (min cosine ~0.97 through this
    backbone), so the first real batch takes bf16 back and the process goes on in float32. With the bar at
    0.9 the same batch confirms bf16 (the other branch), and parity is checked at that bar."""
    monkeypatch.setattr(inference, "PARITY_COSINE", bar)
    model, data_config = pretrained
    images = glyph_images
    fp32 = served(model, data_config, SIZE, precision="float32", channels_last=False).embed_images(images)
    monkeypatch.setattr(inference, "_PROBES", {})
    monkeypatch.setattr(inference, "_real_cosine", [])
    monkeypatch.setattr(inference, "decide", lambda rates, candidates, cosine: InferenceMode(
        True, True, "auto: probe", rates, cosine))  # as on a CPU where the probe found bf16 faster
    monkeypatch.setenv("XBN_CPU_BF16", "")
    monkeypatch.setattr(inference.cpu, "has_native_bf16", lambda: True)
    auto = served(model, data_config, SIZE)
    assert auto.mode.provisional
    b = auto.embed_images(images, batch_size=16)
    cosine, top1 = _parity(fp32, b)
    assert cosine >= bar, (cosine, auto.mode.describe())
    if bar == 0.999:  # at the issue's bar; bf16 itself agreed on only 89% of the glyphs' top-1 neighbours
        assert top1 >= 0.99, top1
    refused = inference._real_cosine[0] < bar
    assert auto.mode.bf16 is not refused and refused is (bar == 0.999)
    if not refused:
        assert np.abs(fp32 - b).max() > 1e-4  # bf16 did run
    if refused:  # the process keeps float32 from then on, and says why
        assert "refused on real images" in auto.mode.chosen_by
        assert not served(model, data_config, SIZE).mode.bf16
    served(model, data_config, SIZE, precision="float32", channels_last=False)


def test_a_bad_force_value_is_an_error_naming_it(monkeypatch, pretrained):
    from xbn.utils.errors import EnvironmentSettingError

    monkeypatch.setenv("XBN_CPU_BF16", "yes")
    with pytest.raises(EnvironmentSettingError, match="XBN_CPU_BF16='yes': use 1"):
        choose_inference_mode(pretrained[0], CPU, SIZE, "auto", False)


def test_folding_batch_norm_keeps_the_embeddings_and_leaves_the_model_alone(pretrained, glyph_images):
    """All 49 BatchNorms of the shipped backbone fold into their convolutions; the copy embeds as the model
    does (float32), and the model itself keeps its BatchNorms."""
    model, data_config = pretrained
    images = torch.randn(4, 3, SIZE, SIZE)
    with torch.no_grad():
        expected = model(images)
    folded = inference.fold_batch_norm(model, images[:1])
    assert folded is not model
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 49
    with torch.no_grad():
        assert torch.allclose(folded(images), expected, atol=1e-5)
        assert torch.equal(model(images), expected)
    unfolded = served(model, data_config, SIZE, precision="float32", channels_last=False)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in unfolded.model.modules())


class _ConvReadTwice(torch.nn.Module):
    """A convolution whose output feeds its BatchNorm and a skip connection: folding would change the skip."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.conv(x)
        return self.norm(y) + y


def test_folding_refuses_a_convolution_whose_output_is_read_elsewhere():
    torch.manual_seed(0)
    model = _ConvReadTwice().eval()
    model.norm.running_mean.uniform_(-1, 1)
    model.norm.running_var.uniform_(0.5, 2)
    assert inference.fold_batch_norm(model, torch.randn(1, 3, 8, 8)) is model


def _small(seed: int = 0):
    torch.manual_seed(seed)
    return build_embedder(load_params(ROOT / "params.yaml", ["model.backbone=test_efficientnet", "model.pretrained=none"]).model)


# Inductor's CPU backend compiles C++: without a compiler the compiled path falls back (tested below).
needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                               reason="no C++ compiler for torch.compile's CPU backend")


@needs_cxx
def test_the_compiled_model_embeds_as_the_eager_one():
    """`inference.compile: true` (the branch `xbn serve` takes on the CPU): torch.compile'd, frozen weights;
    the same embeddings as eager within float32 rounding, and it stays compiled."""
    model, data_config = _small()
    images = torch.randn(3, 3, 32, 32)
    eager = served(model, data_config, 32, precision="float32", channels_last=False, compile=False)
    compiled = served(model, data_config, 32, precision="float32", channels_last=False, compile=True)
    assert not eager.compile and compiled.compile
    expected = eager.embed_tensors(images)
    np.testing.assert_allclose(compiled.embed_tensors(images), expected, atol=1e-5)
    assert isinstance(compiled._compiled, inference.Compiled) and compiled.compile


@needs_cxx
def test_concurrent_first_requests_compile_once_and_agree(monkeypatch):
    """`xbn serve` embeds each request in a thread of its pool, so the first few arrive together: one compiled
    module is built, and every thread gets the eager embeddings of its own images."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    # The model and batch shape of the test above: inductor's caches can serve this compile (one C++ build).
    model, data_config = _small()
    batches = [torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    eager = served(model, data_config, 32, precision="float32", channels_last=False)
    compiled = served(model, data_config, 32, precision="float32", channels_last=False, compile=True)
    built = []
    original = inference.Compiled.__init__

    def counted(self, *args):  # slow enough that, without the lock, the other threads would build one too
        built.append(self)
        time.sleep(0.2)
        original(self, *args)

    monkeypatch.setattr(inference.Compiled, "__init__", counted)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(compiled.embed_tensors, batches))
    assert len(built) == 1 and compiled.compile
    for batch, out in zip(batches, outs):
        np.testing.assert_allclose(out, eager.embed_tensors(batch), atol=1e-5)


def test_when_compiling_fails_it_says_so_and_runs_eager(caplog, monkeypatch, tmp_path):
    """No working C++ compiler (inductor's CPU backend needs one): a warning naming the error, then eager, with
    the same embeddings, and no second attempt."""
    from torch._inductor import codecache, config

    # Kernels an earlier test of this process compiled (in memory, or as .so files in inductor's cache folder)
    # would be reused without calling the compiler: start with none (seen failing in make test's order).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    for cache in (codecache.CppCodeCache, codecache.CppPythonBindingsCodeCache, codecache.CppWrapperCodeCache,
                  codecache.PyCodeCache):
        cache.cache_clear()

    model, data_config = _small(1)
    images = torch.randn(2, 3, 32, 32)
    eager = served(model, data_config, 32, precision="float32", channels_last=False).embed_tensors(images)
    model_served = served(model, data_config, 32, precision="float32", channels_last=False, compile=True)
    with config.patch({"cpp.cxx": (None, "/nonexistent/g++"), "fx_graph_cache": False}):
        out = model_served.embed_tensors(images)
    np.testing.assert_allclose(out, eager, atol=1e-6)
    assert not model_served.compile and model_served._compiled is None
    assert "torch.compile failed (InductorError: InvalidCxxCompiler" in caplog.text


@pytest.mark.parametrize(("setting", "long_running", "expected"), [
    ("auto", True, True), ("auto", False, False), (True, False, True), (False, True, False)])
def test_auto_compiles_only_a_long_running_process(setting, long_running, expected):
    assert inference.resolve_compile(setting, long_running) is expected


def test_xbn_serve_asks_for_a_long_running_model(tmp_path):
    """`xbn serve` (`serving_app`) and only it marks its model source long-running, so `compile: auto` compiles
    there; `xbn search` and `xbn embed` stay eager (a compile would cost more than it saves)."""
    from xbn.stages.serve import model_source, serving_app

    params = load_params(ROOT / "params.yaml", [f"train.checkpoint_dir={tmp_path}"])
    assert serving_app(params, local=True, token=None).state.holder.source.inference["long_running"] is True
    assert model_source(params, local=True).inference["long_running"] is False
    assert model_source(params, local=True, long_running=True).inference == {
        "precision": "auto", "channels_last": "auto", "compile": "auto", "engine": "auto", "long_running": True}
