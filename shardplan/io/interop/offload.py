"""The offload a plan exports: what the job file asks for plus what its offload strategy
decided, the nearest setting a target can write instead, and whether that still fits.

`estimate` may offload more than the job file states (`[offload] strategy`, core/memory.py
`decide_offload`): the plan fits only as the estimate decided it, so that decision is what an
exporter writes. A target that cannot write it exactly writes the nearest setting it has, and
that setting is estimated again (with the target's own accounting where shardplan has one:
`deepspeed` for DeepSpeed, `fsdp2` for FSDP2's CPU offload) to say whether it still fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ...core.estimate_inputs import EstimateInputs
from ...core.memory import Estimate, cpu_limit, estimate_memory
from ...spec.job import JobSpec
from ...spec.units import format_bytes


@dataclass(frozen=True)
class Offload:
    """What goes to the CPU: each kind of state, and under parameter offload how many layers
    of a stage keep their parameters on the GPU (None: as `gpu_param_budget` decides, 0: none)."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False
    resident_layers: int | None = None
    zero_stage: int | None = None  # the ZeRO stage a target writes with it (None: the plan's)

    @property
    def any(self) -> bool:
        return self.params or self.grads or self.optimizer


WHOLE = Offload(params=True, grads=True, optimizer=True, resident_layers=0)
"""FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer states of every layer."""
NONE = Offload()


@dataclass(frozen=True)
class OffloadDecision:
    """The plan's offload as its estimate decided it.

    `offload`: the job's flags and what the strategy added; `changed`: whether the strategy
    added anything (without, exporters write the job's own keys as they always have);
    `inputs`: the decided estimate inputs (None without a model), from which the settings a
    target writes instead are estimated; `layers`: (resident, layers) of each pipeline stage."""

    offload: Offload
    strategy: str = "balanced"
    changed: bool = False
    inputs: EstimateInputs | None = None
    layers: tuple[tuple[int, int], ...] = ()

    def describe(self, offload: Offload | None = None) -> str:
        """`optimizer states, gradients and the parameters of 66 of 80 layers` (the decision, or
        `offload` written instead). Under fsdp2 an offloaded layer takes its gradients and
        optimizer states along (core/memory.py), which the decision's words say."""
        decision = offload is None
        offload = offload or self.offload
        if not offload.any:
            return "no offload"
        parts = [name for flag, name in ((offload.optimizer, "optimizer states"), (offload.grads, "gradients"))
                 if flag]
        if offload.params:
            total, kept = sum(layers for _, layers in self.layers), self.kept_layers(offload)
            layers = ("the parameters of every layer" if kept == 0 or not total
                      else f"the parameters of {total - kept} of {total} layers")
            if decision and not offload.optimizer and self.inputs is not None and self.inputs.framework == "fsdp2":
                layers += " with their gradients and optimizer states"
            parts.append(layers)
        return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"

    def written_as(self, offload: Offload) -> str:
        """`written as optimizer states and gradients`, or `written without offload`."""
        return f"written as {self.describe(offload)}" if offload.any else "written without offload"

    def kept_note(self, target: str) -> str | None:
        """A target that offloads every layer's parameters, where the job's own parameter
        offload keeps some on the GPU (`gpu_param_budget`, as the estimate decided: under
        `deepspeed` none): what the note says, or None."""
        kept = self.kept_layers()
        if not (self.offload.params and kept):
            return None
        total = sum(layers for _, layers in self.layers)
        return f"{target} offloads every layer's parameters; the plan keeps {kept} of {total} layers on the GPU"

    def kept_layers(self, offload: Offload | None = None) -> int:
        """Layers, over all stages, whose parameters stay on the GPU under `offload`."""
        offload = offload or self.offload
        if not offload.params:
            return sum(layers for _, layers in self.layers)
        if offload.resident_layers is None:  # as the budget decided, in the estimate
            return sum(resident for resident, _ in self.layers)
        return sum(min(offload.resident_layers, layers) for _, layers in self.layers)


def decided_offload(job: JobSpec, estimate: Estimate | None) -> OffloadDecision:
    """The decision of `estimate` (of this job's plan; None: no model to estimate, the job's
    flags as written). Under the `deepspeed` accounting offload_optimizer moves the gradients
    with the optimizer states (core/memory.py), so a decided optimizer offload has both."""
    off = job.offload
    asked = Offload(off.params, off.grads, off.optimizer)
    decided = estimate.inputs if estimate is not None else None
    if decided is None:
        return OffloadDecision(asked, off.strategy)
    layers = tuple((d.resident_layers, d.num_layers) for d in estimate.devices)
    changed = (decided.offload_params, decided.offload_grads, decided.offload_optimizer,
               decided.resident_layers) != (off.params, off.grads, off.optimizer, None)
    if not changed:
        return OffloadDecision(asked, off.strategy, False, decided, layers)
    grads = decided.offload_grads or (decided.framework == "deepspeed" and decided.offload_optimizer)
    offload = Offload(decided.offload_params, grads, decided.offload_optimizer, decided.resident_layers)
    return OffloadDecision(offload, off.strategy, True, decided, layers)


# How a note says that the config as written runs out of memory (io/interop/common.py `Note.fails`).
DOES_NOT_FIT = "which does not fit"


@dataclass(frozen=True)
class Fit:
    """A written setting estimated again: whether it fits, and the figures that say so."""

    fits: bool | None
    framework: str
    peak_gpu_bytes: int = 0
    gpu_memory: int | None = None
    host_bytes: int = 0
    host_limit: int | None = None

    def __str__(self) -> str:
        """`fits (fsdp2 accounting: peak 70.12 GiB of 80.00 GiB per GPU, ...)`."""
        if self.fits is None:
            return f"whose fit is unknown ({self.framework} accounting: no GPU memory stated)"
        peak = f"peak {format_bytes(self.peak_gpu_bytes)} of {format_bytes(self.gpu_memory)} per GPU"
        host = f"{format_bytes(self.host_bytes)} of {format_bytes(self.host_limit)} host memory per node"
        if self.fits:
            return f"which fits ({self.framework} accounting: {peak}, {host})"
        over = [peak] if self.peak_gpu_bytes > self.gpu_memory else []
        if self.host_bytes > self.host_limit:
            over.append(host)
        return f"{DOES_NOT_FIT} ({self.framework} accounting: {', '.join(over)})"


def fit_of(decision: OffloadDecision, written: Offload, framework: str | None = None,
           relayout: Callable[[EstimateInputs], EstimateInputs] | None = None) -> Fit:
    """The estimate of the decided plan with `written` in place of its offload, as given (the
    strategy adds nothing), with `framework`'s accounting (None: the job's); `relayout`: the
    layout the target writes where it differs from the plan's (accelerate: no pipeline)."""
    base = decision.inputs
    assert base is not None, "a decision without inputs changed nothing"
    inputs = base.with_(
        offload_params=written.params, offload_grads=written.grads, offload_optimizer=written.optimizer,
        resident_layers=written.resident_layers if written.params else None,
        zero_stage=base.zero_stage if written.zero_stage is None else written.zero_stage,
        framework=framework or base.framework, strategy="conservative",
    )
    if relayout is not None:
        inputs = relayout(inputs)
    estimate = estimate_memory(inputs)
    limit = cpu_limit(inputs) if inputs.gpu_memory is not None else None
    return Fit(estimate.fits, inputs.framework, estimate.peak_gpu_bytes, inputs.gpu_memory,
               estimate.cpu_bytes_per_node, limit)


def same(decision: OffloadDecision, written: Offload) -> bool:
    """Whether `written` offloads what was decided, layer for layer."""
    decided = decision.offload
    return ((decided.params, decided.grads, decided.optimizer) == (written.params, written.grads, written.optimizer)
            and decision.kept_layers(decided) == decision.kept_layers(written))


def fsdp2_stage(stage: int) -> int:
    """The ZeRO stage an FSDP2 target writes: it cannot shard optimizer states alone, so
    ZeRO-1 is written as ZeRO-2 (reshard_after_forward false: gradients sharded too)."""
    return 2 if stage == 1 else stage


def whole_model_offload(decision: OffloadDecision, key: str, stage: int, cannot: str = "",
                        advice: str = "",
                        relayout: Callable[[EstimateInputs], EstimateInputs] | None = None) -> tuple[bool, str]:
    """For a target whose only CPU offload is FSDP2's CPUOffloadPolicy (`key`: true moves the
    parameters, gradients and optimizer states of every layer): the nearest setting to the
    strategy's decision that still fits, and the note that says what was written. Whole
    offload comes first (it offloads what was decided, and more), then none; with neither
    fitting, whole offload is written and the note says it does not fit. `cannot`: why the
    target cannot offload this plan at all (then false is written). `stage`: the job's ZeRO
    stage, estimated as the target writes it (`fsdp2_stage`). shardplan offloads
    parameters only at `zero.stage` 3 (core/checks.py), so below it whole offload is no option
    and the note says whether stage 3 would fit. A setting that does not fit ends the note with
    what to do: `advice` (the target's own way out), else a search with more GPUs. `relayout`:
    as `fit_of`'s."""
    framework = "fsdp2"
    decided = decision.describe()
    head = f"the {decision.strategy} strategy offloads {decided}"
    if cannot:
        fit = fit_of(decision, NONE, framework, relayout)
        return False, f"{cannot}; {head}: written as {key} = false, {fit}{way_out(fit, advice)}"
    if stage != 3:
        fit = fit_of(decision, replace(NONE, zero_stage=fsdp2_stage(stage)), framework, relayout)
        if fit.fits is False and fit_of(decision, replace(WHOLE, zero_stage=3), framework, relayout).fits:
            advice = f"export it with --zero 3, with which {key} = true fits"
        return False, (f"{key} offloads every layer's parameters too, which shardplan plans only with "
                       f"zero.stage = 3 (got {stage}); {head}: written as {key} = false, {fit}"
                       f"{way_out(fit, advice)}")
    fits = {}
    for option in (WHOLE, NONE):
        fits[option] = fit_of(decision, option, framework, relayout)
        if fits[option].fits:
            break
    chosen = next((option for option, fit in fits.items() if fit.fits), WHOLE)
    if same(decision, chosen) and fits[chosen].fits:
        return chosen.params, ""
    written = "true (every layer's parameters, gradients and optimizer states)" if chosen.params else "false"
    return chosen.params, (f"{key} moves the parameters, gradients and optimizer states of every layer together; "
                           f"{head}: written as {key} = {written}, {fits[chosen]}{way_out(fits[chosen], advice)}")


# What a user can always do about a config that does not fit: search the plans that fit.
MORE_GPUS = "search again with more GPUs (`shardplan plan --gpus N`)"


def way_out(fit: Fit, advice: str) -> str:
    """The end of a note whose written setting does not fit: that a run of it stops out of
    memory, and what to do instead (nothing when it fits or its fit is unknown)."""
    if fit.fits is not False:
        return ""
    return f"; as written, a run stops out of memory: {advice or MORE_GPUS}"
