"""The step as a timeline: named moments, each listing exactly the tensors alive in it.

A training step does not hold all its buffers at once: the log-probabilities' gradient dies
before the first layer's backward recomputes its activations, and activations are gone by
the optimizer step. The GPU peak of a rank is therefore the largest of its moments, never a
sum of buffers that do not coexist. Every moment carries its terms by kind (the estimate
table's columns), so the peak's breakdown is the breakdown of one real moment.

Moments, in the order a step visits them:

- `forward`: the end of forward, when the schedule holds the most microbatches' saved
  activations, with the forward's gathered parameters;
- `loss`: (last pipeline stage) the start of backward through the loss and the output head:
  logits, log-probabilities and their gradients;
- `backward`: backward through a transformer layer: its recomputed activations, its gathered
  parameters and its gradients before they are reduced; the sweep's first layer (every
  layer's activations still saved) or, where that holds more, its last (every other layer's
  gradients produced: core/estimate.py `last_layer_backward`);
- `backward end`: every gradient produced, the activations of this microbatch freed (only
  shown when gradients are not already alive during backward); for FSDP2 in torch's pipeline
  stages, the reduction the schedule defers to the end of the step;
- `step`: the optimizer step with its temporaries; activations are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .terms import Term

FORWARD, LOSS, BACKWARD, BACKWARD_END, STEP = "forward", "loss", "backward", "backward end", "step"
MOMENTS = (FORWARD, LOSS, BACKWARD, BACKWARD_END, STEP)
KINDS = ("params", "grads", "optimizer", "activations", "buffers")

MOMENT_HELP = {
    FORWARD: "end of forward: saved activations at the schedule's peak",
    LOSS: "backward through the loss and output head",
    BACKWARD: "backward through a layer: recomputation, gathered parameters, unreduced gradients",
    BACKWARD_END: "every gradient produced, this microbatch's activations freed",
    STEP: "optimizer step: activations freed, step temporaries",
}


@dataclass
class Moment:
    """One moment of the step: what is alive, by kind, in bytes."""

    name: str
    terms: dict[str, list[Term]] = field(default_factory=lambda: {kind: [] for kind in KINDS})

    def add(self, kind: str, terms: list[Term]) -> Moment:
        self.terms[kind].extend(terms)
        return self

    def bytes(self, kind: str) -> int:
        return sum(t.bytes for t in self.terms[kind])

    @property
    def total(self) -> int:
        return sum(self.bytes(kind) for kind in KINDS)

    def breakdown(self) -> dict[str, int]:
        """Bytes by kind and their total (the contract's `devices[].gpu`)."""
        gpu = {kind: self.bytes(kind) for kind in KINDS}
        gpu["total"] = sum(gpu.values())
        return gpu


def peak(moments: list[Moment]) -> Moment:
    """The moment that needs the most memory; the earliest of equal ones."""
    best = moments[0]
    for moment in moments[1:]:
        if moment.total > best.total:
            best = moment
    return best
