"""The Intra-Batch training loss (Seidenschwarz et al., ICML 2021, Sec. 3.3): the batch passes through the
message-passing network, its outputs are classified with a label-smoothed, temperature-scaled cross-entropy,
and an auxiliary cross-entropy of the same kind on the backbone embeddings keeps them discriminative on their
own, since inference uses them without the MPN.

Class labels arrive as codes over the whole manifest; the classifiers cover the training classes only, so the
codes are remapped to 0..C-1 by a buffer built from the training labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xbn.models.mpn import MessagePassingNetwork


class IntraBatchLoss(nn.Module):
    class_index: torch.Tensor  # buffer: a training label -> its classifier row (-1: not a training class)

    def __init__(self, mpn: MessagePassingNetwork, train_labels, temperature: float,
                 label_smoothing: float = 0.1, aux_weight: float = 1.0):
        super().__init__()
        classes = torch.unique(torch.as_tensor(train_labels, dtype=torch.long))
        if len(classes) < 2:
            raise ValueError("the Intra-Batch loss needs at least two training classes")
        index = torch.full((int(classes.max()) + 1,), -1, dtype=torch.long)
        index[classes] = torch.arange(len(classes))
        self.register_buffer("class_index", index)
        dim = int(mpn.config["dim"])  # the config dict also holds the float dropout
        self.mpn = mpn
        # The authors' classifier on the MPN outputs: a BatchNorm "neck" with a frozen bias, then a bias-free
        # linear layer initialised with std 0.001; the backbone's auxiliary classifier is a plain linear one.
        self.neck = nn.BatchNorm1d(dim)
        self.neck.bias.requires_grad_(False)
        self.classifier = nn.Linear(dim, len(classes), bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)
        self.aux_classifier = nn.Linear(dim, len(classes))
        self.temperature, self.label_smoothing, self.aux_weight = temperature, label_smoothing, aux_weight

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        known = labels < len(self.class_index)
        targets = self.class_index[labels.clamp(max=len(self.class_index) - 1)]
        if not bool((known & (targets >= 0)).all()):
            raise ValueError("a batch label is not a training class: the MPN classifiers cover the train "
                             "split only")
        return targets

    def logits(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MPN logits, backbone logits), before the temperature."""
        return self.classifier(self.neck(self.mpn(embeddings))), self.aux_classifier(embeddings)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = self.targets(labels)
        mpn_logits, aux_logits = self.logits(embeddings)

        def ce(logits):  # Eq. 5: CE with label smoothing on logits / temperature
            return F.cross_entropy(logits / self.temperature, targets, label_smoothing=self.label_smoothing)

        return ce(mpn_logits) + self.aux_weight * ce(aux_logits)
