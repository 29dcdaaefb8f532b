"""The names a params file gives, resolved against the installed libraries when params load, before any data
is read (the schema in `xbn.config` checks shapes and values; this checks what the names refer to)."""

from __future__ import annotations

from pathlib import Path

from xbn.config import ConfigError, Params, load_params


def load_checked(path: str | Path | None = "params.yaml", overrides: list[str] | None = None) -> Params:
    """`load_params`, then `check_names`: what a stage that builds a model or a loss starts with."""
    params = load_params(path, overrides)
    check_names(params)
    return params


def check_names(params: Params) -> None:
    """Resolve every name the params give against what is installed, before any data is read: loss.name and
    loss.miner (pytorch-metric-learning classes, or ours) and the arguments in loss.params, loss.miner_params
    and refine.loss_params (the constructors' signatures), model.backbone (timm) and train.device (CUDA).
    Raises ConfigError naming the key and the close matches. The libraries are imported here, not at module
    import: seconds in a fresh process, which the commands that build none of these need not pay."""
    from xbn.losses import FILLED_LOSS_ARGUMENTS, check_arguments, loss_class, miner_class
    from xbn.models.backbone import check_backbone

    loss = params.loss
    check_arguments(loss_class(loss.name), loss.params, "loss.params", filled=FILLED_LOSS_ARGUMENTS,
                    owner=f"loss.name={loss.name}")
    if loss.miner is not None:
        check_arguments(miner_class(loss.miner), loss.miner_params, "loss.miner_params",
                        owner=f"loss.miner={loss.miner}")
    check_arguments(loss_class("MultiSimilarityLoss"), params.refine.loss_params, "refine.loss_params",
                    owner="MultiSimilarityLoss (the refiner's loss)")
    check_backbone(params.model.backbone, params.model.pretrained, params.model.pretrained_path)
    device = params.train.device
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise ConfigError(f"train.device: {device} but this machine has "
                              f"{f'{count} CUDA device(s)' if count else 'no CUDA device'}: use auto or cpu")
