"""MemVir (Ko, Gu and Kim, "Learning with Memory-based Virtual Classes for Deep Metric Learning", ICCV 2021).

A wrapper around a classification/proxy loss (NormalizedSoftmaxLoss, CosFaceLoss, ArcFaceLoss, ProxyNCALoss,
ProxyAnchorLoss, ...: any PML loss with one class weight per class in `W` or `proxies`). Past steps'
embeddings, labels and class weights are queued; the loss of the current step also classifies N of those past
steps as *virtual classes*: their embeddings join the batch, their class weights join the current ones, and
their labels are offset by C per step so that they never coincide with a real class (Sec. 3, Fig. 2).

Which past steps, and step-pacing (the paper's curriculum, Sec. 3; interpreted from the authors' code,
navervision/MemVir `loss/memvir.py`): nothing is queued during the first `warmup_iterations` steps. From then
on the queue holds the last N*(M+1) steps; at step t (counted from the end of the warm-up) the virtual steps
are t-(M+1), t-2(M+1), ..., t-n(M+1) with n = min(N, floor(t/(M+1))). So the number of classes climbs a
staircase, C*(1+n): one more step's C classes (and B embeddings) every M+1 steps, until C*(N+1). The current
step is queued after the virtual steps were chosen, so it never sees itself. Queued tensors are detached: the
gradient reaches the current embeddings and class weights only.

PML has no such wrapper; the swap of the class weights for the concatenated ones goes through
`torch.func.functional_call`, so the wrapped loss's own code computes the loss over C*(1+n) classes.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["MemVir", "proxy_slot"]

# (attribute, class axis): the softmax family's W is (embedding_size, C), proxy losses' (C, embedding_size).
_SLOTS = (("W", 1), ("proxies", 0))


def proxy_slot(loss: nn.Module, num_classes: int) -> tuple[str, int] | None:
    """Where the loss keeps exactly one trainable weight vector per class, or None (e.g. SupConLoss, or
    SoftTripleLoss/SubCenterArcFaceLoss with several centres per class, whose labels cannot be offset)."""
    for name, axis in _SLOTS:
        weight = getattr(loss, name, None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[axis] == num_classes:
            return name, axis
    return None


class MemVir(nn.Module):
    """loss(embeddings, labels) with up to `num_steps` (N) past steps, `step_gap` (M) apart, as classes.

    Labels must be 0..num_classes-1. The queues (and the step counter) are part of `state_dict`, so a resumed
    run takes the same virtual classes as the uninterrupted one.
    """

    def __init__(self, loss: nn.Module, num_classes: int, num_steps: int, step_gap: int,
                 warmup_iterations: int = 0):
        super().__init__()
        slot = proxy_slot(loss, num_classes)
        if slot is None:
            raise ValueError(
                f"loss.memvir needs a classification/proxy loss with one weight per class ('W' of shape "
                f"(embedding_size, {num_classes}) or 'proxies' of shape ({num_classes}, embedding_size)), "
                f"such as NormalizedSoftmaxLoss, CosFaceLoss, ArcFaceLoss, ProxyNCALoss, ProxyAnchorLoss; "
                f"loss.name={type(loss).__name__} has none")
        if num_steps < 1 or step_gap < 0 or warmup_iterations < 0:
            raise ValueError("MemVir needs num_steps >= 1, step_gap >= 0 and warmup_iterations >= 0")
        self.loss = loss
        self.slot, self.class_axis = slot
        self.num_classes, self.num_steps, self.step_gap = num_classes, num_steps, step_gap
        self.warmup_iterations = warmup_iterations
        self.iteration = 0
        self.last_num_classes = num_classes  # classes of the last call: C * (1 + virtual steps)
        # One entry per step: (embeddings, labels, class weights), the oldest first.
        self.queue: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = deque(
            maxlen=num_steps * (step_gap + 1))

    @property
    def proxies(self) -> torch.Tensor:
        return getattr(self.loss, self.slot)

    def num_virtual_steps(self) -> int:
        return min(self.num_steps, len(self.queue) // (self.step_gap + 1))

    def virtual_steps(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The queued steps used now, newest first: M+1, 2(M+1), ..., n(M+1) steps back."""
        newest_first = list(reversed(self.queue))
        gap = self.step_gap + 1
        return [newest_first[k * gap + self.step_gap] for k in range(self.num_virtual_steps())]

    def expand(self, embeddings: torch.Tensor, labels: torch.Tensor, proxies: torch.Tensor,
               past: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        """The batch, labels and class weights with the past steps appended; the k-th past step's labels are
        offset by k*C, so virtual class k*C + y is class y's weight as it was k(M+1) steps ago."""
        c = self.num_classes
        embeddings = torch.cat([embeddings, *(e for e, _, _ in past)])
        labels = torch.cat([labels, *(y + c * (k + 1) for k, (_, y, _) in enumerate(past))])
        proxies = torch.cat([proxies, *(w for _, _, w in past)], dim=self.class_axis)
        return embeddings, labels, proxies

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor,
                indices_tuple=None) -> torch.Tensor:
        # `indices_tuple` is always None here: the config refuses a miner and rho with MemVir (Params).
        active = self.iteration >= self.warmup_iterations
        self.iteration += 1
        past = self.virtual_steps() if active else []
        if active:
            self.queue.append((embeddings.detach().clone(), labels.detach().clone(),
                               self.proxies.detach().clone()))
        self.last_num_classes = self.num_classes * (1 + len(past))
        if not past:
            return self.loss(embeddings, labels)
        embeddings, labels, proxies = self.expand(embeddings, labels, self.proxies, past)
        return self._loss_over(proxies, embeddings, labels)

    def _loss_over(self, proxies: torch.Tensor, embeddings: torch.Tensor,
                   labels: torch.Tensor) -> torch.Tensor:
        # PML losses also read the class count (ProxyAnchor's one-hot, the large-margin target mask) or a
        # label per proxy (ProxyNCA): set them for the duration of the call.
        total = proxies.shape[self.class_axis]
        overrides = {"num_classes": total, "proxy_labels": torch.arange(total, device=labels.device)}
        saved = {k: getattr(self.loss, k) for k in overrides if hasattr(self.loss, k)}
        try:
            for key in saved:
                setattr(self.loss, key, overrides[key])
            return functional_call(self.loss, {self.slot: proxies}, (embeddings, labels))
        finally:
            for key, value in saved.items():
                setattr(self.loss, key, value)

    def get_extra_state(self):
        steps = list(self.queue)
        return {"iteration": self.iteration, "embeddings": [e for e, _, _ in steps],
                "labels": [y for _, y, _ in steps], "proxies": [w for _, _, w in steps]}

    def set_extra_state(self, state):
        self.iteration = int(state["iteration"])
        steps = zip(state["embeddings"], state["labels"], state["proxies"])
        self.queue = deque(steps, maxlen=self.queue.maxlen)

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, num_steps={self.num_steps}, step_gap={self.step_gap}, "
                f"warmup_iterations={self.warmup_iterations}")
