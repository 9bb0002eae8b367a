"""The plan as Megatron-LM command-line arguments (pretrain_gpt.py), ready for a shell.

Argument names, values and meanings: Megatron-LM's parser, megatron/training/arguments.py
(`add_megatron_arguments`), whose groups are built from dataclasses by
megatron/training/argument_utils.py (`ArgumentGroupFactory`: field `foo_bar` is
`--foo-bar`; a boolean field defaulting to true is `--no-foo-bar`): ModelParallelConfig
(megatron/core/model_parallel_config.py), TransformerConfig
(megatron/core/transformer/transformer_config.py), TrainingConfig, CheckpointConfig, RNGConfig
and DistributedInitConfig (megatron/training/config/). The file and line of every argument
written here are listed with the tests (tests/data/interop/megatron_arguments.json).
Megatron's `--optimizer adam` is AdamW with decoupled weight decay
(megatron/core/optimizer/__init__.py: apex FusedAdam or torch.optim.AdamW).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import replace

from ...spec.job import parse_order
from ...spec.model import RopeScaling
from ...core.pipeline import split_layers
from .common import REFUSED, Exported, Note, Plan, unexpressed
from .offload import Offload, fit_of, same, way_out

TARGET = "megatron"

# Megatron's rank orders (fastest axis first): the default tp-cp-ep-dp-pp, and
# --use-tp-pp-dp-mapping's tp-cp-ep-pp-dp (common_config.py, DistributedInitConfig).
_DEFAULT_ORDER = ("tp", "cp", "dp", "pp")
_TP_PP_DP_ORDER = ("tp", "cp", "pp", "dp")
_NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}
_POSITIONS = {"rope": "rope", "learned": "learned_absolute"}
# What Megatron-LM's llama3 RoPE scaling fixes: only the factor is an argument
# (--rope-scaling-factor, arguments.py); the rest are the keyword defaults of
# RotaryEmbedding._apply_scaling (megatron/core/models/common/embeddings/rotary_pos_embedding.py
# at the commit in tests/data/interop/megatron_arguments.json), which RotaryEmbedding.__init__
# calls with the factor alone. The values are Llama 3.1's (its config.json rope_scaling).
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

COVERED = (
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.order", "parallel.sequence_parallel",
    "parallel.virtual_stages", "parallel.first_stage_layers", "parallel.last_stage_layers",
    "parallel.micro_batch_size", "parallel.num_microbatches", "parallel.pipeline_schedule",
    "parallel.communication_timeout", "zero.stage", "offload.optimizer", "train.precision", "train.optimizer",
    "train.lr", "train.seq_len", "train.steps", "train.seed", "train.global_batch_size",
    "train.activation_checkpointing", "train.attention", "checkpoint.dir", "checkpoint.every",
)


def to_megatron(plan: Plan) -> Exported:
    job = plan.job
    par, zero, off, train = job.parallel, job.zero, job.offload, job.train
    notes: list[Note] = []
    args: list[str] = []

    def add(flag: str, value: object = None) -> None:
        args.append(flag)
        if value is not None:
            args.append(str(value))

    add("--tensor-model-parallel-size", par.tp)
    add("--pipeline-model-parallel-size", par.pp)
    add("--context-parallel-size", par.cp)
    if par.sequence_parallel:
        add("--sequence-parallel")
    _order(par, add, notes)
    if par.pp > 1:
        _pipeline(plan, add, notes)
    add("--micro-batch-size", par.micro_batch_size)
    add("--global-batch-size", plan.global_batch)  # Megatron: microbatches = global / (micro * dp)
    written = _decided_offload(plan, notes) if plan.offload.changed else None
    stage = zero.stage if written is None else written.zero_stage
    if written is None and off.optimizer and stage == 0:
        stage = 1  # --use-precision-aware-optimizer, which the offload needs, needs the distributed optimizer
        notes.append(_distributed_note(par.dp))
    if stage == 1:
        add("--use-distributed-optimizer")
    elif stage in (2, 3):
        # Megatron-FSDP: optim_grads is ZeRO-2, optim_grads_params ZeRO-3 (arguments.py,
        # --data-parallel-sharding-strategy). Megatron's --use-torch-fsdp2 would refuse
        # pipeline parallel and tied embeddings (validate_args).
        add("--use-megatron-fsdp")
        add("--data-parallel-sharding-strategy", "optim_grads" if stage == 2 else "optim_grads_params")
        add("--ckpt-format", "fsdp_dtensor")  # the only checkpoint format Megatron-FSDP takes
    if zero.hybrid:
        notes.append(Note("zero.hybrid", "hybrid sharding is not exported: Megatron-FSDP shards over the whole "
                                         "data-parallel group here"))
    if zero.min_num_params:
        notes.append(Note("zero.min_num_params", "Megatron-FSDP shards every transformer layer; a size "
                                                 "threshold is not exported"))
    if written is not None and written.optimizer:
        _optimizer_offload(add)
    elif written is None and off.optimizer:
        _optimizer_offload(add)
        if zero.stage not in (0, 1):  # stage 0 is written as 1 (its note above)
            notes.append(Note("offload.optimizer", "megatron offloads the optimizer with its distributed optimizer "
                                                   "(--use-distributed-optimizer, ZeRO-1)"))
    for key in ("params", "grads"):
        if getattr(off, key):
            notes.append(Note(f"offload.{key}", f"megatron cannot offload {key} to the CPU"))
    if train.precision in ("bf16-mixed", "bf16"):
        add("--bf16")
        if train.precision == "bf16":
            notes.append(Note("train.precision", "megatron keeps fp32 main parameters with --bf16; pure bf16 is "
                                                 "written as bf16 mixed precision"))
    elif train.precision == "fp16-mixed":
        add("--fp16")
    if train.activation_checkpointing in ("selective", "op"):
        add("--recompute-granularity", "selective")
        if train.activation_checkpointing == "op":
            notes.append(Note("train.activation_checkpointing", "megatron has no operator policy like torchtitan's; "
                                                                "written as its selective (attention-core) recomputation"))
    elif train.activation_checkpointing == "full":
        add("--recompute-granularity", "full")
        add("--recompute-method", "uniform")
        add("--recompute-num-layers", 1)
    add("--attention-backend", "flash" if train.attention == "flash" else "unfused")
    add("--seq-length", train.seq_len)
    if train.optimizer == "sgd":
        add("--optimizer", "sgd")
    else:
        add("--optimizer", "adam")
        if train.optimizer == "adamw8bit":
            notes.append(Note("train.optimizer", "megatron has no 8-bit AdamW; written as adam (AdamW)"))
    add("--lr", train.lr)
    add("--train-iters", train.steps)
    add("--seed", train.seed)
    minutes = math.ceil(par.communication_timeout / 60)
    add("--distributed-timeout-minutes", minutes)
    if par.communication_timeout % 60:
        notes.append(Note("parallel.communication_timeout", f"megatron takes whole minutes; "
                                                            f"{par.communication_timeout} s written as {minutes}"))
    if job.checkpoint.dir:
        add("--save", job.checkpoint.dir)
        add("--save-interval", job.checkpoint.every)
    _model(plan, add, notes)
    said = {note.path for note in notes}
    notes += [note for note in unexpressed(plan, COVERED, TARGET) if note.path not in said]
    return Exported(args, notes)


def _optimizer_offload(add) -> None:
    """Megatron's CPU offload of the whole optimizer (its HybridDeviceOptimizer; the fraction
    defaults to 0.0, megatron/core/optimizer/optimizer_config.py)."""
    add("--optimizer-cpu-offload")
    add("--optimizer-offload-fraction", "1.0")
    add("--use-precision-aware-optimizer")  # validate_args: the offload runs on its code path


def _distributed_note(dp: int) -> Note:
    return Note("zero.stage", "megatron offloads the optimizer only with its distributed optimizer; written with "
                              f"--use-distributed-optimizer (ZeRO-1 over {dp} data-parallel rank{'s' if dp > 1 else ''})")


def _decided_offload(plan: Plan, notes: list[Note]) -> Offload:
    """What Megatron writes for the offload strategy's decision: the optimizer states only
    (--optimizer-cpu-offload; it has no parameter or gradient offload), on the distributed
    optimizer that --use-precision-aware-optimizer requires (megatron/core/optimizer/__init__.py,
    `get_megatron_optimizer`; Megatron-FSDP enables it itself). What differs from the decision,
    or does not fit, gets a note: estimated with the job's accounting at the job's stage
    (shardplan has no accounting of Megatron's own; its distributed optimizer shards only the
    optimizer states, which are on the CPU here)."""
    decision, stage, dp = plan.offload, plan.job.zero.stage, plan.job.parallel.dp
    decided = decision.offload
    written = Offload(optimizer=decided.optimizer, zero_stage=1 if decided.optimizer and stage == 0 else stage)
    if written.zero_stage != stage:
        notes.append(_distributed_note(dp))
    fit = fit_of(decision, replace(written, zero_stage=None))
    if not same(decision, written) or not fit.fits:
        notes.append(Note("offload", f"megatron offloads optimizer states only (--optimizer-cpu-offload); the "
                                     f"{decision.strategy} strategy offloads {decision.describe()}: "
                                     f"{decision.written_as(written)}, {fit}{way_out(fit, '')}"))
    return written


def _order(par, add, notes: list[Note]) -> None:
    used = {axis for axis in ("tp", "cp", "dp", "pp") if getattr(par, axis) > 1}
    mine = [axis for axis in parse_order(par.order) if axis in used]
    if mine == [axis for axis in _DEFAULT_ORDER if axis in used]:
        return
    if mine == [axis for axis in _TP_PP_DP_ORDER if axis in used]:
        add("--use-tp-pp-dp-mapping")
        return
    notes.append(Note("parallel.order", f"megatron orders ranks tp-cp-dp-pp or (--use-tp-pp-dp-mapping) "
                                        f"tp-cp-pp-dp; {par.order!r} is not exported"))


def _pipeline(plan: Plan, add, notes: list[Note]) -> None:
    par = plan.job.parallel
    chunked = par.pipeline_schedule == "interleaved-1f1b"
    if par.pipeline_schedule not in ("1f1b", "interleaved-1f1b"):
        notes.append(Note("parallel.pipeline_schedule", f"megatron runs 1F1B (interleaved with virtual stages); "
                                                        f"{par.pipeline_schedule!r} is not exported"))
    if chunked and par.virtual_stages > 1:
        add("--num-virtual-stages-per-pipeline-rank", par.virtual_stages)
        if par.pp > 1 and par.num_microbatches % par.pp:
            # Megatron-LM's get_forward_backward_func: "number of microbatches is not divisible
            # by pipeline-parallel size when using interleaved schedule" (torch runs such counts).
            notes.append(Note("parallel.num_microbatches",
                              f"megatron's interleaved schedule needs microbatches divisible by pp ({par.pp}); "
                              f"{par.num_microbatches} runs under torch's schedule, not megatron's"))
    elif par.virtual_stages > 1:
        notes.append(Note("parallel.virtual_stages", "megatron interleaves virtual stages under 1F1B only"))
    _stage_layers(plan, chunked and par.virtual_stages > 1, add, notes)


def _stage_layers(plan: Plan, interleaved: bool, add, notes: list[Note]) -> None:
    """The layers of each pipeline stage as Megatron-LM takes them: an even split needs the
    layers to divide by pp; --decoder-first/last-pipeline-num-layers fix the end stages, and the
    stages between must then split the rest evenly (megatron/training/arguments.py, "Number of
    layers should be divisible by the pipeline-model-parallel size";
    megatron/core/transformer/transformer_config.py, "number of layers at middle stage ... must be
    divisible by the middle pipeline model parallel size"). The plan's split is written with
    the fewest of the two flags that give it; one whose middle stages differ cannot be."""
    par = plan.job.parallel
    if plan.shape is None or par.pp == 1:
        if par.first_stage_layers:
            add("--decoder-first-pipeline-num-layers", par.first_stage_layers)
        if par.last_stage_layers:
            add("--decoder-last-pipeline-num-layers", par.last_stage_layers)
        return
    stages = par.pp * (par.virtual_stages if interleaved else 1)
    counts = split_layers(plan.shape.num_layers, stages, par.first_stage_layers, par.last_stage_layers)
    if len(set(counts)) == 1:
        return
    split = "/".join(map(str, counts))
    key = "parallel.first_stage_layers" if par.first_stage_layers or par.last_stage_layers else "parallel.pp"
    if interleaved:
        notes.append(Note(key, f"megatron {REFUSED} its interleaved schedule here needs the layers split evenly "
                               f"over pp x virtual stages (arguments.py); the plan's {stages} stages hold {split}"))
        return
    middle = set(counts[1:-1])
    if len(middle) > 1:
        notes.append(Note(key, f"megatron {REFUSED} the stages between the first and the last must hold equal "
                               f"layers (transformer_config.py); the plan's {par.pp} stages hold {split}"))
        return
    even = middle.pop() if middle else None
    if counts[0] != even:
        add("--decoder-first-pipeline-num-layers", counts[0])
    if even is not None and counts[-1] != even:
        add("--decoder-last-pipeline-num-layers", counts[-1])


def _model(plan: Plan, add, notes: list[Note]) -> None:
    shape, model = plan.shape, plan.job.model
    if shape is None:
        if model.source is not None:
            notes.append(Note("model", "megatron needs the architecture; a bare parameter count is not exported"))
        return
    add("--num-layers", shape.num_layers)
    add("--hidden-size", shape.hidden_size)
    add("--ffn-hidden-size", shape.ffn_hidden_size)
    add("--num-attention-heads", shape.num_heads)
    if shape.num_kv_heads != shape.num_heads:
        add("--group-query-attention")
        add("--num-query-groups", shape.num_kv_heads)
    if shape.head_dim * shape.num_heads != shape.hidden_size:
        add("--kv-channels", shape.head_dim)
    # validate_args: max_position_embeddings >= seq_length (rope models may train longer)
    add("--max-position-embeddings", max(shape.max_seq_len or 0, plan.job.train.seq_len))
    add("--normalization", _NORMS[shape.norm])
    if shape.activation == "swiglu":
        add("--swiglu")
    elif shape.activation == "geglu":
        notes.append(Note("model.activation", "megatron's gated MLP is SwiGLU (--swiglu); geglu is not exported"))
    if shape.position_embedding in _POSITIONS:
        add("--position-embedding-type", _POSITIONS[shape.position_embedding])
        if shape.position_embedding == "rope":
            _rotary_base(shape.rope_theta, add, notes)
            _rope_scaling(shape.rope_scaling, add, notes)
    else:
        notes.append(Note("model.position_embedding", f"megatron has no {shape.position_embedding} positions"))
    if not shape.tie_embeddings:
        add("--untie-embeddings-and-output-weights")
    biases = (shape.qkv_bias, shape.out_bias, shape.mlp_bias)
    if biases == (False, False, False):
        add("--disable-bias-linear")
    elif biases == (True, False, False):
        add("--disable-bias-linear")
        add("--add-qkv-bias")
    elif biases != (True, True, True):
        notes.append(Note("model", "megatron sets biases for all linear layers or for qkv only; "
                                   f"qkv/out/mlp = {biases} is not exported"))
    if shape.shared_layer_norm:
        notes.append(Note("model.shared_layer_norm", "megatron's GPT layer has two norms; a shared norm is "
                                                     "not exported"))
    if shape.moe:
        add("--num-experts", shape.num_experts)
        add("--moe-router-topk", shape.experts_per_token)
    dropout = plan.job.model.dropout
    add("--attention-dropout", dropout)  # Megatron's default is 0.1: always written
    add("--hidden-dropout", dropout)
    notes.append(Note("model.vocab_size", f"megatron takes the vocabulary ({shape.vocab_size}) from the tokenizer "
                                          "(--tokenizer-type ...) and pads it to --make-vocab-size-divisible-by"))


def _rotary_base(theta: float | None, add, notes: list[Note]) -> None:
    """--rotary-base, an integer in Megatron (arguments.py: `type=int`, default 10000, which
    few current models use: Llama 3's is 500000): written when the model gives its base and
    it is a whole number, else a note says what to give."""
    if theta is not None and theta.is_integer():
        add("--rotary-base", int(theta))
    elif theta is not None:
        notes.append(Note("model.rope_theta", f"megatron's --rotary-base takes an integer; {theta} is not exported "
                                              "(megatron would run its default, 10000)"))
    else:
        notes.append(Note("model.rope_theta", "the model gives no rotary base: give --rotary-base as its config "
                                              "says (rope_theta; megatron's default is 10000, Llama 3's 500000), "
                                              "or set model.rope_theta"))


def _rope_scaling(scaling: RopeScaling | None, add, notes: list[Note]) -> None:
    """Llama 3.1's scaling as Megatron takes it: --use-rope-scaling and --rope-scaling-factor
    (a float; default 8.0). Megatron hard-codes the other three values (`_MEGATRON_LLAMA3`);
    a model whose values differ gets a note, since no argument can say them."""
    if scaling is None:
        return
    add("--use-rope-scaling")
    add("--rope-scaling-factor", scaling.factor)
    differing = [f"{key} {getattr(scaling, key)} (megatron: {fixed})" for key, fixed in _MEGATRON_LLAMA3.items()
                 if getattr(scaling, key) != fixed]
    if differing:
        notes.append(Note("model.rope_scaling", f"megatron fixes what --rope-scaling-factor leaves out; this model's "
                                                f"{', '.join(differing)} cannot be exported "
                                                "(RotaryEmbedding._apply_scaling, rotary_pos_embedding.py)"))


def dumps(args: list[str]) -> str:
    """One flag per line, continued with backslashes: paste after `torchrun pretrain_gpt.py`."""
    lines, current = [], []
    for arg in args:
        if arg.startswith("--") and current:
            lines.append(" ".join(current))
            current = []
        current.append(shlex.quote(arg))
    if current:
        lines.append(" ".join(current))
    return " \\\n".join(lines) + "\n"
