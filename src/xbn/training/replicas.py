"""What the ranks of a data-parallel run must share, checked across the process group.

On one machine every rank reads the same files. Across machines (`xbn train --nnodes N`) each node reads its
own params file, manifest and, on `--resume`, `last.pt`; a difference would train a model no single run gives,
or hang a collective on mismatched shapes. `check_ranks_agree` compares them once before training, and every
rank raises the same error, naming the ranks, their hosts and what differs.

After every epoch `compare_replicas` fingerprints each rank's weights and cross-batch memory: under DDP they
are identical bit for bit (the same averaged gradients, the same gathered global batch), so rank 0 records
the fingerprints in metrics/train.json (`replicas`) and warns when a rank's differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xbn.config import ConfigError, Params, flatten
from xbn.data import DatasetError
from xbn.utils import distributed
from xbn.utils.io import file_digest

log = logging.getLogger(__name__)

# What the training depends on (dvc.yaml's train params), less what a node may set for itself: where its copy
# of the files lies and how many loader processes read them. The manifest's content is compared instead.
SHARED_SECTIONS = ("data.", "model.", "memory.", "loss.", "train.")
NODE_LOCAL_KEYS = {"data.root", "data.manifest", "data.num_workers",
                   "train.checkpoint_dir", "train.metrics_dir"}


def rank_facts(params: Params, resume: bool) -> dict:
    """What this rank trains from: its host, the shared params, and the sha256 of the manifest and (when
    resuming) of last.pt, None where the file is missing."""
    record = json.loads(json.dumps(flatten(params), sort_keys=True, default=str))
    manifest, last = Path(params.data.manifest), Path(params.train.checkpoint_dir) / "last.pt"
    shared = {k: v for k, v in record.items() if k.startswith(SHARED_SECTIONS) and k not in NODE_LOCAL_KEYS}
    return {"host": socket.gethostname(), "params": shared,
            "manifest": (str(manifest), file_digest(manifest) if manifest.is_file() else None),
            "last": (str(last), file_digest(last) if resume and last.is_file() else None)}


def check_ranks_agree(params: Params, resume: bool) -> None:
    """Raise `disagreement` of every rank's `rank_facts` on every rank. A collective: all ranks call it;
    nothing to do in a single process."""
    if distributed.world_size() == 1:
        return
    if problem := disagreement(distributed.gather_objects(rank_facts(params, resume))):
        raise problem


def disagreement(facts: list[dict]) -> ConfigError | DatasetError | None:
    """The first way a rank's `rank_facts` differ from rank 0's (ranks in order), as the error to raise: a
    ConfigError for the params or last.pt, a DatasetError for the manifest; None when they all agree."""
    first = facts[0]

    def who(rank: int) -> str:
        return f"rank {rank} ({facts[rank]['host']})"

    def file(rank: int, what: str) -> str:
        path, sha = facts[rank][what]
        return f"{path} ({'missing' if sha is None else f'sha256 {sha[:12]}'}) on {who(rank)}"

    for rank, mine in enumerate(facts[1:], start=1):
        differ = sorted(k for k in first["params"].keys() | mine["params"].keys()
                        if first["params"].get(k) != mine["params"].get(k))
        if differ:
            shown = "; ".join(f"{k}: {first['params'].get(k)!r} on {who(0)}, {mine['params'].get(k)!r} on "
                              f"{who(rank)}" for k in differ[:6]) + (f" (and {len(differ) - 6} more)"
                                                                      if len(differ) > 6 else "")
            return ConfigError(f"the nodes train with other params: {shown}; run every node with the same "
                               "params file and --set values")
        if mine["manifest"][1] != first["manifest"][1]:
            return DatasetError(
                f"data.manifest differs between the nodes: {file(0, 'manifest')}, {file(rank, 'manifest')}; "
                "every node must train on the same data: put data.root and the manifest on a shared filesystem "
                "(or copy them unchanged to every node)")
        if mine["last"][1] != first["last"][1]:
            return ConfigError(
                f"--resume: last.pt differs between the nodes: {file(0, 'last')}, {file(rank, 'last')}; every "
                "rank must resume from the same checkpoint: put train.checkpoint_dir on a shared filesystem")
    return None


def state_digest(state: Mapping[str, Any]) -> str:
    """sha256 over a state dict's keys, tensors (dtype, shape and bytes) and other values (their repr)."""
    digest = hashlib.sha256()
    _digest_into(digest, state)
    return digest.hexdigest()


def _digest_into(digest, state: Mapping[str, Any]) -> None:
    for key in sorted(state):
        value = state[key]
        digest.update(key.encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, Mapping):  # extra state holding tensors (the memory's batch-mean sums)
            _digest_into(digest, value)
        else:  # extra state: the queue pointer, the fill flag
            digest.update(repr(value).encode())


def compare_replicas(model: nn.Module, memory: nn.Module | None) -> dict | None:
    """`replica_report` of every rank's fingerprints (`state_digest`) of its model's parameters and its
    cross-batch memory; None in a single process. A collective: all ranks call it; rank 0 warns when they
    differ. The model's buffers are left out: with model.freeze_bn=false on the CPU each rank's BatchNorm
    statistics follow its own slice (the trainer warns about that)."""
    if distributed.world_size() == 1:
        return None
    report = replica_report(distributed.gather_objects(
        {"host": socket.gethostname(), "weights": state_digest(dict(model.named_parameters())),
         "memory": state_digest(memory.state_dict()) if memory is not None else None}))
    if not report["identical"] and distributed.is_main():
        log.warning("the ranks' weights or memory differ: DDP should keep them identical, so this run does "
                    "not equal a single-process one (%s)", json.dumps(report))
    return report


def replica_report(ranks: list[dict]) -> dict:
    """What metrics/train.json records under `replicas`: the ranks' hosts and fingerprints, in rank order, and
    whether they are all the same."""
    weights, memory = [r["weights"] for r in ranks], [r["memory"] for r in ranks]
    return {"world_size": len(ranks), "hosts": [r["host"] for r in ranks], "weights_sha256": weights,
            "memory_sha256": memory, "identical": len(set(weights)) == 1 and len(set(memory)) == 1}


__all__ = ["check_ranks_agree", "compare_replicas", "disagreement", "rank_facts", "replica_report",
           "state_digest"]
