"""Constants shared by tests in several folders (importable because pytest puts tests/ on sys.path)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "data.glyphs.classes=24", "data.glyphs.images_per_class=4", "data.glyphs.image_size=32",
    "data.image_size=32", "data.num_workers=0", "data.val_classes=0.25",
    "model.backbone=test_efficientnet", "model.pretrained=none", "model.embedding_dim=16",
    "train.epochs=2", "train.warmup_epochs=1", "train.batch_size=16", "train.samples_per_class=4",
    "train.log_every=1", "train.probe_size=8", "eval.k=[1, 2, 4]", "eval.batch_size=32",
    # A random-init tiny net puts every pair beyond the pair-margin miner's margins: use all pairs.
    "loss.miner=null", "tracking.enabled=false",
]
