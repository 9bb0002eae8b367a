"""`shardplan import` / `export` at the edges a new user meets first.

- accelerate's `deepspeed_config_file` is read as accelerate reads it (and refused where
  accelerate refuses it); every fsdp_config key read but not carried over is named, and so
  is every launcher key (use_cpu among them: shardplan has no CPU setting);
- torchtitan's float8 converters, its rule on pipeline_parallel_layers_per_stage, its
  [checkpoint] folder, interval and keep_latest_k with its defaults, and the pipeline
  schedule names torch accepts (others refused);
- a DeepSpeed config that does not say its data-parallel degree says so;
- one export note per key; a file of command-line arguments gets one clear line.

Expected values come from the frameworks' own code where it is installed (the `interop`
extra: accelerate 1.15, torchtitan 0.2.2, deepspeed 0.19.8), else from the file and line
cited beside them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, run_cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def notes_of(result) -> list[str]:
    return [line for line in result.err_lines if line.startswith("import: ") or line.startswith("export: ")]


# -- accelerate: deepspeed_config_file -------------------------------------------------------

# A DeepSpeed config as accelerate's docs show it for `deepspeed_config_file` (ZeRO-3 with
# CPU optimizer offload), with explicit batch keys.
DS_FILE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True},
}

# What `accelerate config` writes with a DeepSpeed file: mixed_precision null
# (accelerate/commands/config/cluster.py: `if distributed_type == DEEPSPEED and
# use_deepspeed_config: mixed_precision = None`).
ACC_WITH_FILE = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: ds.json
  zero3_init_flag: true
mixed_precision: null
num_machines: 1
num_processes: 8
"""


def accelerate_plugin(config: str, monkeypatch):
    """accelerate's own reading of a config: the launch parser and config loader
    (`_validate_launch_command`), the fields `launch_command` passes on, the worker's
    environment (`prepare_deepspeed_cmd_env`) and the worker's `DeepSpeedPlugin()` built from
    it (accelerate/commands/launch.py, accelerate/utils/launch.py, accelerate/utils/dataclasses.py)."""
    pytest.importorskip("accelerate", reason="accelerate is in the `interop` extra")
    pytest.importorskip("deepspeed", reason="deepspeed is in the `interop` extra")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", config, "train.py"])
    args, defaults, mixed_from_config = _validate_launch_command(args)
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mixed_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as launch_command sets it
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    return DeepSpeedPlugin()


def test_accelerate_reads_the_deepspeed_file_as_accelerate_does(tmp_path, monkeypatch):
    (tmp_path / "acc.yaml").write_text(ACC_WITH_FILE)
    text = json.dumps(DS_FILE, indent=2)
    (tmp_path / "ds.json").write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if '"contiguous_gradients"' in t)
    monkeypatch.chdir(tmp_path)
    result = run_cli("import", "acc.yaml", "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    job = result.json["job"]
    plugin = accelerate_plugin("acc.yaml", monkeypatch)
    assert job["zero"]["stage"] == plugin.zero_stage == 3
    assert job["parallel"]["num_microbatches"] == plugin.gradient_accumulation_steps == 4
    assert job["parallel"]["micro_batch_size"] == plugin.deepspeed_config["train_micro_batch_size_per_gpu"]
    assert plugin.offload_optimizer_device == "cpu" and job["offload"]["optimizer"] is True
    assert job["train"]["precision"] == "bf16-mixed" and plugin.deepspeed_config["bf16"]["enabled"] is True
    # The same plan as the DeepSpeed file imported alone over accelerate's 8 processes.
    alone = run_cli("import", "ds.json", "--dp", "8", "--set", "model.preset=llama-3-8b", "--json")
    assert alone.code == 0, alone.err
    for table in ("parallel", "zero", "offload", "train"):
        assert job[table] == alone.json["job"][table], table
    # Notes about the DeepSpeed file's keys point into it, at their lines.
    notes = notes_of(result)
    assert f"import: ds.json:{line}: zero_optimization.contiguous_gradients: not read: shardplan has no setting " \
           "for it" in notes
    assert {"path": "zero_optimization.contiguous_gradients", "file": "ds.json", "line": line,
            "message": "not read: shardplan has no setting for it"} in result.json["notes"]
    assert not any("deepspeed_config_file" in line for line in notes)  # read, and no contradiction


def test_accelerate_opens_the_file_from_the_working_directory(tmp_path, monkeypatch):
    """accelerate opens deepspeed_config_file as written, from where `accelerate launch` runs
    (accelerate/utils/deepspeed.py, HfDeepSpeedConfig: `os.path.exists(config_file_or_dict)`),
    not beside the YAML: with a ds.json in both folders, the working directory's is read."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "acc.yaml").write_text(ACC_WITH_FILE)
    (tmp_path / "configs" / "ds.json").write_text(json.dumps(DS_FILE))
    (tmp_path / "ds.json").write_text(json.dumps({**DS_FILE, "zero_optimization": {"stage": 2}}))
    monkeypatch.chdir(tmp_path)
    plugin = accelerate_plugin("configs/acc.yaml", monkeypatch)
    result = run_cli("import", "configs/acc.yaml", "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    assert result.json["job"]["zero"]["stage"] == plugin.zero_stage == 2
    assert "import: configs/acc.yaml:4: deepspeed_config.deepspeed_config_file: read ds.json from the working " \
           "directory, where accelerate opens it, not configs/ds.json beside this file" in result.err_lines


def test_accelerate_file_beside_the_yaml_is_read_with_a_note(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "acc.yaml").write_text(ACC_WITH_FILE)
    (tmp_path / "configs" / "ds.json").write_text(json.dumps(DS_FILE))
    monkeypatch.chdir(tmp_path)
    result = run_cli("import", "configs/acc.yaml", "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    assert result.json["job"]["zero"]["stage"] == 3
    assert any(line.startswith("import: configs/acc.yaml:4: deepspeed_config.deepspeed_config_file: ds.json is not "
                               "in the working directory") and "read configs/ds.json, beside this file" in line
               for line in result.err_lines), result.err


def test_accelerate_missing_deepspeed_file_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "acc.yaml").write_text(ACC_WITH_FILE)
    monkeypatch.chdir(tmp_path)
    result = run_cli("import", "configs/acc.yaml", "--set", "model.preset=llama-3-8b")
    assert result.code == 2 and result.out == ""
    assert result.err_lines == [
        "configs/acc.yaml:4: deepspeed_config.deepspeed_config_file: ds.json: no such file (accelerate opens it "
        "from the working directory of `accelerate launch`; looked for ds.json (the working directory) and "
        "configs/ds.json)"]
    doc = run_cli("import", "configs/acc.yaml", "--json").json
    assert doc["error"]["exit_code"] == 2
    assert [(p["file"], p["line"], p["path"]) for p in doc["error"]["problems"]] == [
        ("configs/acc.yaml", 4, "deepspeed_config.deepspeed_config_file")]


@pytest.mark.parametrize("line,key", [("mixed_precision: bf16", "mixed_precision"),
                                      ("  zero_stage: 2", "deepspeed_config.zero_stage")])
def test_accelerate_refuses_settings_beside_the_file(tmp_path, monkeypatch, line, key):
    """With deepspeed_config_file, accelerate refuses the accelerate keys the file decides
    (DeepSpeedPlugin._deepspeed_config_checks: ValueError "When using `deepspeed_config_file`,
    the following accelerate config variables will be ignored"); so does the import."""
    text = ACC_WITH_FILE.replace("mixed_precision: null", line) if key == "mixed_precision" else \
        ACC_WITH_FILE.replace("  zero3_init_flag: true", f"  zero3_init_flag: true\n{line}")
    (tmp_path / "acc.yaml").write_text(text)
    (tmp_path / "ds.json").write_text(json.dumps(DS_FILE))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="When using `deepspeed_config_file`"):
        accelerate_plugin("acc.yaml", monkeypatch)
    result = run_cli("import", "acc.yaml", "--set", "model.preset=llama-3-8b")
    assert result.code == 2 and len(result.err_lines) == 1, result.err
    assert result.err_lines[0].startswith(f"acc.yaml:{text.splitlines().index(line) + 1}: {key}: accelerate refuses "
                                          "it beside deepspeed_config_file")


def test_accelerate_deepspeed_file_without_zero_optimization_is_refused(tmp_path, monkeypatch):
    """accelerate requires zero_optimization in the file (DeepSpeedPlugin.__post_init__: "Please
    specify the ZeRO optimization config in the DeepSpeed config.")."""
    (tmp_path / "acc.yaml").write_text(ACC_WITH_FILE)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="Please specify the ZeRO optimization config"):
        accelerate_plugin("acc.yaml", monkeypatch)
    result = run_cli("import", "acc.yaml")
    assert result.code == 2 and len(result.err_lines) == 1
    assert "deepspeed_config.deepspeed_config_file: ds.json has no zero_optimization" in result.err


def test_accelerate_deepspeed_file_problems_point_into_it(tmp_path, monkeypatch):
    """A rule broken by the DeepSpeed file's keys is reported at that file's line: its
    ZeRO-3 parameter offload, with the stage set to 2 on the command line."""
    bad = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    (tmp_path / "acc.yaml").write_text(ACC_WITH_FILE)
    (tmp_path / "ds.json").write_text(json.dumps(bad, indent=2))
    monkeypatch.chdir(tmp_path)
    result = run_cli("import", "acc.yaml", "--set", "model.preset=llama-3-8b", "--set", "zero.stage=2")
    assert result.code == 2
    assert any(line.startswith("ds.json:5: zero_optimization.offload_param.device: offload.params:")
               for line in result.err_lines), result.err


def test_accelerate_inline_deepspeed_defaults_to_zero_2(write, monkeypatch):
    """Without zero_stage accelerate runs ZeRO-2 (DeepSpeedPlugin.__post_init__:
    ACCELERATE_DEEPSPEED_ZERO_STAGE defaults to 2), not stage 0."""
    path = write("acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero3_init_flag: false\n"
                             "num_machines: 1\nnum_processes: 8\n")
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    assert result.json["job"]["zero"]["stage"] == accelerate_plugin(path, monkeypatch).zero_stage == 2


def test_accelerate_zero3_init_flag_below_stage_3_is_named(write, monkeypatch):
    """accelerate's examples/config_yaml_templates/deepspeed.yaml writes `zero3_init_flag` beside a
    stage-1 config; below stage 3 accelerate turns the flag off (DeepSpeedPlugin.__post_init__,
    checked with accelerate's own plugin), and the import names it as not read."""
    path = write("acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
                             "  zero3_init_flag: true\nnum_machines: 1\nnum_processes: 8\n")
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    notes = {n["path"]: n["message"] for n in result.json["notes"]}
    assert notes["deepspeed_config.zero3_init_flag"] == "not read: it acts at ZeRO stage 3 only (the config's stage is 2)"
    with pytest.warns(UserWarning, match="only applicable for ZeRO Stage 3"):
        assert accelerate_plugin(path, monkeypatch).zero3_init_flag is False


# -- accelerate: fsdp_config keys read but not carried over -----------------------------------

ACC_FSDP1 = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 1
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_use_orig_params: true
  fsdp_sync_module_states: true
  fsdp_cpu_ram_efficient_loading: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_min_num_params: 1000000
  fsdp_activation_checkpointing_offload: false
  fsdp_offload_params: false
mixed_precision: bf16
num_machines: 1
num_processes: 8
"""
# The keys accelerate's FullyShardedDataParallelPlugin takes (accelerate/utils/dataclasses.py)
# that do not change a job key: each must be named with its line and why.
NOT_CARRIED = ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
               "fsdp_cpu_ram_efficient_loading", "fsdp_state_dict_type", "fsdp_transformer_layer_cls_to_wrap",
               "fsdp_min_num_params", "fsdp_activation_checkpointing_offload")


def test_accelerate_fsdp_keys_not_carried_are_named(write):
    path = write("acc.yaml", ACC_FSDP1)
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    lines = ACC_FSDP1.splitlines()
    noted = {n["path"]: n for n in result.json["notes"]}
    for key in NOT_CARRIED:
        note = noted[f"fsdp_config.{key}"]
        assert note["line"] == next(i for i, line in enumerate(lines, 1) if line.strip().startswith(f"{key}:"))
        assert note["message"].startswith("not read: ") and len(note["message"]) > len("not read: ") + 20
    # One line per key on stderr, in the file's order.
    said = [line for line in notes_of(result) if "fsdp_config." in line]
    assert len(said) == len(set(said)) == len(NOT_CARRIED)
    assert said == sorted(said, key=lambda line: int(line.split(":")[2]))
    assert result.json["job"]["zero"]["stage"] == 3  # FULL_SHARD, read


def test_accelerate_no_wrap_is_said(write):
    """accelerate's default policy is NO_WRAP (FullyShardedDataParallelPlugin: FSDP_AUTO_WRAP_POLICY
    defaults to "NO_WRAP"): the whole model is one FSDP unit."""
    text = "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n" \
           "  fsdp_reshard_after_forward: true\n"
    result = run_cli("import", write("acc.yaml", text), "--set", "model.preset=llama-3-8b")
    assert result.code == 0, result.err
    assert any("fsdp_config.fsdp_auto_wrap_policy: not given, accelerate's default NO_WRAP: the whole model is one "
               "FSDP unit" in line for line in result.err_lines), result.err
    bad = run_cli("import", write("bad.yaml", text + "  fsdp_auto_wrap_policy: LAYER_WRAP\n"))
    assert bad.code == 2 and "fsdp_config.fsdp_auto_wrap_policy: must be one of TRANSFORMER_BASED_WRAP" in bad.err


# -- float8 -----------------------------------------------------------------------------------

FLOAT8_NOTE = ("float8 is not modelled: memory and step time are estimated as the same run without it "
               "(train.precision = 'bf16-mixed': matmuls, saved activations and all-gathers in 16 bits)")


def test_torchtitan_float8_says_what_is_estimated(write):
    """torchtitan 0.2.2 registers the converter as "quantize.linear.float8"
    (components/quantization/float8.py, register_model_converter) configured by
    [quantize.linear.float8] (config/job_config.py, Quantize)."""
    text = ('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["quantize.linear.float8"]\n'
            '[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n[parallelism]\n'
            'data_parallel_shard_degree = 8\n')
    result = run_cli("import", write("tt.toml", text))
    assert result.code == 0, result.err
    notes = notes_of(result)
    assert f"import: {write('tt.toml', text)}:4: model.converters: 'quantize.linear.float8': {FLOAT8_NOTE}" in notes
    assert any(":5: quantize.linear.float8: configures the converters of model.converters, which are not modelled"
               in line for line in notes), notes
    assert not any("no effect" in line for line in notes), notes
    assert tomllib.loads(result.out)["train"]["precision"] == "bf16-mixed"


def test_torchtitan_old_float8_table_is_named(write):
    """torchtitan before 0.2 had [float8] and the converter "float8"; 0.2.2's ConfigManager
    refuses the table (unknown field of JobConfig)."""
    text = ('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["float8"]\n[float8]\n'
            'enable_fsdp_float8_all_gather = true\n[parallelism]\ndata_parallel_shard_degree = 8\n')
    path = write("tt.toml", text)
    result = run_cli("import", path)
    assert result.code == 0, result.err
    assert f"import: {path}:4: model.converters: 'float8' (torchtitan 0.2 names it 'quantize.linear.float8'): " \
           f"{FLOAT8_NOTE}" in result.err_lines
    assert f"import: {path}:5: float8: torchtitan 0.2 moved [float8] to [quantize.linear.float8] (0.2.2 refuses " \
           "it); configures the converters of model.converters, which are not modelled" in result.err_lines
    config_module = pytest.importorskip("torchtitan.config", reason="torchtitan is in the `interop` extra")
    with pytest.raises(ValueError, match="float8"):
        config_module.ConfigManager().parse_args(["--job.config_file", path])


def test_accelerate_fp8_says_the_same(write):
    text = "distributed_type: FSDP\nmixed_precision: fp8\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n" \
           "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
    result = run_cli("import", write("acc.yaml", text), "--set", "model.preset=llama-3-8b")
    assert result.code == 0, result.err
    assert any(line.endswith(f":2: mixed_precision: fp8 is read as bf16-mixed: {FLOAT8_NOTE}")
               for line in result.err_lines), result.err


# -- torchtitan: pipeline_parallel_layers_per_stage -------------------------------------------

def torchtitan_stages(path: str, num_layers: int, pp: int):
    """What torchtitan's own `pipeline_llm` makes of the config (torchtitan/distributed/
    pipeline_parallel.py): the module names of every stage, or the ValueError it raises. The
    split into modules is stopped before it needs a model or a device mesh."""
    config_module = pytest.importorskip("torchtitan.config", reason="torchtitan is in the `interop` extra")
    from torchtitan.distributed import pipeline_parallel

    class Accepted(Exception):
        pass

    def stop(model, pp_mesh, schedule, device, module_names_per_stage):
        raise Accepted(module_names_per_stage)

    job_config = config_module.ConfigManager().parse_args(["--job.config_file", path])
    saved = pipeline_parallel.pipeline_module_split
    pipeline_parallel.pipeline_module_split = stop
    try:
        pipeline_parallel.pipeline_llm(None, SimpleNamespace(pp=pp, get_mesh=lambda name: None), job_config, None,
                                       SimpleNamespace(n_layers=num_layers), None, None)
    except Accepted as accepted:
        return accepted.args[0]
    except ValueError as refused:
        return refused
    finally:
        pipeline_parallel.pipeline_module_split = saved
    raise AssertionError("pipeline_llm returned without splitting")


# (pp, schedule, layers_per_stage or None): llama3 8B has 32 layers (torchtitan's
# models/llama3/__init__.py, "8B": n_layers=32); embedding and head weigh one layer each.
PIPELINE_CASES = [
    (4, "Interleaved1F1B", 5),  # ceil(34 / 5) = 7 stages over 4 ranks
    (4, "Interleaved1F1B", 4),  # 9 stages
    (4, "Interleaved1F1B", 17),  # 2 stages
    (4, "Interleaved1F1B", 9),  # 4 stages: 1 per rank, a multi-stage schedule needs 2
    (4, "Interleaved1F1B", 3),  # 12 stages: 3 per rank
    (4, "1F1B", 9),  # 4 stages, 1 per rank
    (2, "1F1B", 9),  # 4 stages, 2 per rank on a single-stage schedule
    (2, "GPipe", 17),  # 2 stages
    (8, "LoopedBFS", 2),  # 17 stages
    (8, "LoopedBFS", None),  # torchtitan's default: 2 stages per rank
    (16, "Interleaved1F1B", None),  # 32 stages of 34 effective layers: 1 each, weights fit
    (32, "Interleaved1F1B", None),  # 64 stages > 34 effective layers
    (32, "1F1B", 1),  # 34 stages over 32 ranks
]


@pytest.mark.parametrize("pp,schedule,layers_per_stage", PIPELINE_CASES)
def test_layers_per_stage_follow_torchtitan(write, pp, schedule, layers_per_stage):
    text = (f'[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = {2 * pp}\n'
            f'[parallelism]\ndata_parallel_shard_degree = 2\npipeline_parallel_degree = {pp}\n'
            f'pipeline_parallel_schedule = "{schedule}"\n'
            + (f"pipeline_parallel_layers_per_stage = {layers_per_stage}\n" if layers_per_stage else ""))
    path = write("tt.toml", text)
    theirs = torchtitan_stages(path, 32, pp)
    mine = run_cli("import", path, "--json")
    if isinstance(theirs, ValueError):
        assert mine.code == 2, mine.out
        assert len(mine.err_lines) == 1, mine.err
        key = "pipeline_parallel_layers_per_stage" if layers_per_stage else "pipeline_parallel_degree"
        assert f"parallelism.{key}: " in mine.err_lines[0] and "torchtitan refuses it" in mine.err_lines[0]
        assert "pipeline_parallel.py" in mine.err_lines[0]
        return
    assert mine.code == 0, mine.err
    par = mine.json["job"]["parallel"]
    counts = [sum(name.startswith("layers.") for name in part) for part in theirs]
    chunks = len(counts) // pp
    assert par.get("virtual_stages", 1) == chunks
    if len(set(counts)) > 1 and 0 not in counts:  # shardplan keeps the first and last stage's layers
        assert (par["first_stage_layers"], par["last_stage_layers"]) == (counts[0], counts[-1])


def test_refused_layers_per_stage_message(write):
    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 2\n'
            'pipeline_parallel_degree = 4\npipeline_parallel_schedule = "Interleaved1F1B"\n'
            'pipeline_parallel_layers_per_stage = 5\n')
    path = write("tt.toml", text)
    result = run_cli("import", path)
    # torchtitan/distributed/pipeline_parallel.py, pipeline_llm: num_virtual_stages =
    # ceil((n_layers + first_stage_less_layers + last_stage_less_layers) / layers_per_stage) must be
    # divisible by the pipeline parallel size: ceil((32 + 1 + 1) / 5) = 7, and 4 does not divide 7.
    assert result.code == 2 and result.err_lines == [
        f"{path}:8: parallelism.pipeline_parallel_layers_per_stage: 5 layers per stage make ceil((32 layers + "
        "first_stage_less_layers 1 + last_stage_less_layers 1) / 5) = 7 stages, which pipeline_parallel_degree 4 "
        "does not divide; torchtitan refuses it (the number of virtual stages must be divisible by the pipeline "
        "parallel size: torchtitan/distributed/pipeline_parallel.py, pipeline_llm)"]


# -- torchtitan: [checkpoint] ------------------------------------------------------------------

def torchtitan_checkpoint(path: str) -> tuple[str, int, int] | None:
    """(folder, interval, keep_latest_k) as torchtitan's CheckpointManager takes them from the
    parsed config: folder = os.path.join(job.dump_folder, checkpoint.folder)
    (torchtitan/components/checkpoint.py, CheckpointManager.__init__; base_folder is
    job.dump_folder, torchtitan/train.py)."""
    config_module = pytest.importorskip("torchtitan.config", reason="torchtitan is in the `interop` extra")
    config = config_module.ConfigManager().parse_args(["--job.config_file", path])
    c = config.checkpoint
    if not c.enable:
        return None
    return os.path.normpath(os.path.join(config.job.dump_folder, c.folder)), c.interval, c.keep_latest_k


@pytest.mark.parametrize("tables", [
    '[checkpoint]\nenable = true\n',  # every default: ./outputs/checkpoint, 500, 10
    '[job]\ndump_folder = "./runs/8b"\n[checkpoint]\nenable = true\nfolder = "ckpt"\ninterval = 250\n',
    '[checkpoint]\nenable = true\nfolder = "/scratch/ckpt"\ninterval = 100\nkeep_latest_k = 3\n',
    '[checkpoint]\nfolder = "ckpt"\ninterval = 100\n',  # not enabled
])
def test_torchtitan_checkpoint_is_read_and_written_back(write, tables):
    text = f'[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n{tables}'
    path = write("tt.toml", text)
    theirs = torchtitan_checkpoint(path)
    result = run_cli("import", path, "--json")
    assert result.code == 0, result.err
    job = result.json["job"]
    if theirs is None:
        assert "checkpoint" not in job
        assert any("checkpoint.folder: not read: checkpoint.enable is not true" in line for line in result.err_lines)
        return
    ckpt = job["checkpoint"]
    assert (os.path.normpath(ckpt["dir"]), ckpt["every"], ckpt["keep"]) == theirs
    # Exported back, torchtitan saves to the same folder, as often, keeping as many.
    back = write("back.toml", run_cli("export", write("job.toml", run_cli("import", path).out), "--to",
                                      "torchtitan").out)
    assert torchtitan_checkpoint(back) == theirs


def test_torchtitan_checkpoint_defaults_without_torchtitan(write):
    """torchtitan 0.2.2's defaults (config/job_config.py: Job.dump_folder "./outputs",
    Checkpoint.folder "checkpoint", interval 500, keep_latest_k 10)."""
    path = write("tt.toml", '[parallelism]\ndata_parallel_shard_degree = 8\n[checkpoint]\nenable = true\n')
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    assert result.json["job"]["checkpoint"] == {"dir": "outputs/checkpoint", "every": 500, "keep": 10}


def test_torchtitan_keep_latest_k_edges(write):
    base = '[parallelism]\ndata_parallel_shard_degree = 8\n[training]\nsteps = 1000\n[checkpoint]\nenable = true\n'
    # 0 keeps every checkpoint (job_config.py, keep_latest_k: "If 0, keep all checkpoints"): one
    # every 300 steps and one at the last step (components/checkpoint.py, _should_save): 4.
    zero = run_cli("import", write("zero.toml", base + "interval = 300\nkeep_latest_k = 0\n"),
                   "--set", "model.preset=llama-3-8b", "--json")
    assert zero.code == 0, zero.err
    assert zero.json["job"]["checkpoint"]["keep"] == math.ceil(1000 / 300) == 4
    # 1 is refused (CheckpointManager.__init__: "We need to maintain at least 2 checkpoint replicas").
    one = run_cli("import", write("one.toml", base + "keep_latest_k = 1\n"), "--set", "model.preset=llama-3-8b")
    assert one.code == 2 and len(one.err_lines) == 1 and ":7: checkpoint.keep_latest_k: torchtitan refuses 1" in one.err
    # A shardplan job keeping 1 is written as 2, with a note.
    job = write("job.toml", '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 8\n[zero]\nstage = 3\n'
                            '[checkpoint]\ndir = "ckpt"\nkeep = 1\n')
    exported = run_cli("export", job, "--to", "torchtitan")
    assert exported.code == 0, exported.err
    assert tomllib.loads(exported.out)["checkpoint"]["keep_latest_k"] == 2
    assert any(line.startswith("export: checkpoint.keep: torchtitan keeps at least 2") for line in exported.err_lines)


def test_torchtitan_enable_checkpoint_old_name(write):
    """`enable_checkpoint` was torchtitan's name before 0.2 (renamed `enable` in torchtitan PR
    #1607); 0.2.2's ConfigManager refuses it. The import reads it, and says so."""
    path = write("tt.toml", '[parallelism]\ndata_parallel_shard_degree = 8\n[checkpoint]\nenable_checkpoint = true\n'
                            'folder = "ckpt"\ninterval = 250\n')
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    assert result.json["job"]["checkpoint"] == {"dir": "outputs/ckpt", "every": 250, "keep": 10}
    assert f"import: {path}:4: checkpoint.enable_checkpoint: torchtitan 0.2 renamed it checkpoint.enable and " \
           "refuses this name: read as enable" in result.err_lines
    config_module = pytest.importorskip("torchtitan.config", reason="torchtitan is in the `interop` extra")
    with pytest.raises(ValueError, match="enable_checkpoint"):
        config_module.ConfigManager().parse_args(["--job.config_file", path])


# -- DeepSpeed: the data-parallel degree --------------------------------------------------------

def test_deepspeed_micro_batch_alone_says_dp_is_assumed(write):
    """DeepSpeed derives the data-parallel size from the launch: train_batch_size =
    micro batch x accumulation x data-parallel world size (deepspeed/runtime/config.py,
    `_set_batch_related_parameters`); a config with the micro batch alone does not say it."""
    path = write("ds.json", json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    assert result.json["job"]["parallel"] == {"micro_batch_size": 4, "num_microbatches": 1}
    assert f"import: {path}:1: train_micro_batch_size_per_gpu: the data-parallel degree is not in the config " \
           "(DeepSpeed takes it from the launch): planned as dp 1; give --dp N or --world N" in result.err_lines
    for flags in (("--dp", "8"), ("--world", "8")):
        given = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json", *flags)
        assert given.code == 0, given.err
        assert given.json["job"]["parallel"]["dp"] == 8
        assert not any("data-parallel degree" in line for line in given.err_lines)
    # All three batch keys say it: no note.
    full = write("full.json", json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                          "gradient_accumulation_steps": 2}))
    assert not any("data-parallel degree" in line for line in run_cli("import", full).err_lines)


# -- export: one note per key -------------------------------------------------------------------

def test_accelerate_export_of_tiny_gpt2_cpu_names_the_batch_once():
    result = run_cli("export", "tiny-gpt2-cpu", "--to", "accelerate")
    assert result.code == 0, result.err
    notes = notes_of(result)
    batch = [line for line in notes if "micro batch" in line or "micro_batch_size" in line]
    # presets/jobs/tiny-gpt2-cpu.toml: micro_batch_size = 4, no accumulation.
    assert batch == ["export: parallel.micro_batch_size: accelerate takes batch size and gradient accumulation in "
                     "the training script (Accelerator(gradient_accumulation_steps=...)); micro batch 4, 1 step"]


@pytest.mark.parametrize("target", ("deepspeed", "torchtitan", "accelerate", "megatron"))
@pytest.mark.parametrize("preset", ("tiny-gpt2-cpu", "llama-3-8b-h100", "llama-2-70b-3d", "gpt2-xl-offload-a100-40gb",
                                    "llama-3-70b-qlora", "mixtral-8x7b-h100"))
def test_export_names_each_key_once(preset, target):
    result = run_cli("export", preset, "--to", target, "--json")
    assert result.code == 0, result.err
    paths = [note["path"] for note in result.json["notes"]]
    assert len(paths) == len(set(paths)), paths


# -- a file of command-line arguments -----------------------------------------------------------

def test_megatron_arguments_are_one_clear_line(tmp_path):
    out = str(tmp_path / "args.txt")
    assert run_cli("export", "llama-2-70b-3d", "--to", "megatron", "-o", out).code == 0
    result = run_cli("import", out)
    assert result.code == 2 and result.out == ""
    assert result.err_lines == [
        f"{out}:1: --tensor-model-parallel-size: command-line arguments (Megatron-LM's pretrain_gpt.py takes these) "
        "are not imported: `shardplan import` reads a DeepSpeed JSON, a torchtitan TOML or an accelerate YAML config; "
        "`shardplan export --to megatron` writes Megatron-LM arguments"]


@pytest.mark.parametrize("text,line,flag", [
    ("#!/bin/bash\n# pretrain\ntorchrun --nproc_per_node 8 pretrain_gpt.py \\\n  --num-layers 32 \\\n"
     "  --bf16 $EXTRA\n", 4, "--num-layers"),
    ("--tensor-model-parallel-size 8 \\\n--num-layers: 80\n", 1, "--tensor-model-parallel-size"),  # not YAML either
    ("--lr=3e-4 --bf16\n", 1, "--lr"),
    # Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh: arrays of arguments, torchrun's
    # first (`--nproc_per_node` line 48, `--use-mcore-models` line 56), the script named at the
    # end: the first argument that is not torchrun's is named.
    ("#!/bin/bash\nDISTRIBUTED_ARGS=(\n    --nproc_per_node $GPUS_PER_NODE\n    --nnodes $NUM_NODES\n)\n"
     "MODEL_ARGS=(\n    --use-mcore-models\n    --num-layers 32\n)\n"
     "torchrun ${DISTRIBUTED_ARGS[@]} \\\n    \"$PRETRAIN_SCRIPT_PATH\" ${MODEL_ARGS[@]}\n", 7, "--use-mcore-models"),
])
def test_launch_scripts_are_one_clear_line(write, text, line, flag):
    path = write("pretrain.sh", text)
    result = run_cli("import", path, "--json")
    assert result.code == 2 and len(result.err_lines) == 1, result.err
    assert result.err_lines[0].startswith(f"{path}:{line}: {flag}: command-line arguments")
    [problem] = result.json["error"]["problems"]
    assert (problem["line"], problem["path"]) == (line, flag)


def test_a_yaml_mapping_is_not_taken_for_arguments(write):
    """Only text that is not a YAML mapping (a shell script's words parse as one YAML scalar)
    is read as command-line arguments; a mapping keeps the usual message."""
    path = write("m.yaml", "args: --foo 1\n")
    result = run_cli("import", path)
    assert result.code == 2 and result.err_lines == [
        f"{path}: not a DeepSpeed config (JSON), a torchtitan job config (TOML) or an accelerate config (YAML)"]


# -- torchtitan: a pipeline schedule torch does not know ------------------------------------

# The names torch's `get_schedule_class` accepts, in any case, in its order (torch 2.13.0,
# torch/distributed/pipelining/schedules.py, get_schedule_class: schedule_map); any other name
# raises ValueError there. `torch_schedule_names` reads them off torch itself where installed.
TORCH_SCHEDULES = ["1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "PipelineScheduleSingle",
                   "PipelineScheduleMulti", "ZBVZeroBubble", "DualPipeV"]


def torch_schedule_names() -> list[str]:
    """The names torch's `get_schedule_class` accepts, as its own refusal lists them ("Unknown
    schedule name ... The valid options are [...]")."""
    import ast

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules", reason="torch is in the `run` extra")
    with pytest.raises(ValueError) as refused:
        schedules.get_schedule_class("NoSuchSchedule")
    return ast.literal_eval(str(refused.value).split("The valid options are ", 1)[1])


TT_SCHEDULE = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\n[parallelism]\n'
               'data_parallel_shard_degree = 2\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "{}"\n')


def test_torchtitan_unknown_schedule_is_refused(write):
    """torchtitan's `pipeline_llm` first asks torch's `get_schedule_class` for the schedule's
    class (torchtitan/distributed/pipeline_parallel.py), which raises ValueError for a name it
    does not know: the import refuses it in one line listing torch's names, instead of
    planning 1F1B."""
    path = write("tt.toml", TT_SCHEDULE.format("Interleaved1F1Bv2"))
    result = run_cli("import", path, "--json")
    assert result.code == 2 and result.out.startswith("{"), result.err
    assert result.err_lines == [
        f"{path}:9: parallelism.pipeline_parallel_schedule: must be one of {', '.join(TORCH_SCHEDULES)}, in any case "
        "(got 'Interleaved1F1Bv2'): torchtitan refuses other names (torch/distributed/pipelining/schedules.py, "
        "get_schedule_class)"]
    [problem] = result.json["error"]["problems"]
    assert (problem["line"], problem["path"]) == (9, "parallelism.pipeline_parallel_schedule")
    assert torch_schedule_names() == TORCH_SCHEDULES
    refused = torchtitan_stages(path, 32, 2)  # llama3 8B: 32 layers
    assert isinstance(refused, ValueError) and "Unknown schedule name 'Interleaved1F1Bv2'" in str(refused)


def test_torchtitan_schedules_torch_knows_are_read(write):
    """Every name torch accepts, in any case, imports (one shardplan does not plan, such as
    ZBVZeroBubble, with the 1f1b note); torchtitan's `pipeline_llm` accepts each too."""
    paths = []
    for name in TORCH_SCHEDULES:
        for written in (name, name.lower()):
            paths.append(write(f"{written}-{len(paths)}.toml", TT_SCHEDULE.format(written)))
            result = run_cli("import", paths[-1])
            assert result.code == 0, (written, result.err)
            if name == "ZBVZeroBubble":
                assert f"import: {paths[-1]}:9: parallelism.pipeline_parallel_schedule: {written!r} has no shardplan " \
                       "schedule; planned as 1f1b" in result.err_lines
    for path in paths:
        assert not isinstance(torchtitan_stages(path, 32, 2), ValueError), path


def test_torchtitan_schedule_is_not_read_without_pipeline_parallel(write):
    """torchtitan builds a schedule only under pipeline parallel (torchtitan/train.py: pipelining_fn
    only if parallel_dims.pp_enabled), so a name it does not know is refused only then."""
    text = TT_SCHEDULE.format("NoSuchSchedule").replace("pipeline_parallel_degree = 2", "pipeline_parallel_degree = 1")
    assert run_cli("import", write("tt.toml", text)).code == 0


# -- accelerate: launcher keys and the CPU -----------------------------------------------------

# What `accelerate config` writes for one machine (accelerate/commands/config/cluster.py; the keys
# are ClusterConfig's fields, accelerate/commands/config/config_args.py), with the launch keys of
# a multi-machine run.
ACC_LAUNCH = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_process_ip: 10.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 16
rdzv_backend: c10d
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
LAUNCHER_NOTE = "not read: a launcher setting (the machines, not the plan)"
CPU_NOTE = "not read: shardplan has no CPU setting (`shardplan run` uses the CPU with gloo where no GPU exists)"


def test_accelerate_launcher_keys_are_named(write):
    path = write("acc.yaml", ACC_LAUNCH)
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b", "--json")
    assert result.code == 0, result.err
    read = ("distributed_type", "mixed_precision", "num_machines", "num_processes")
    lines = ACC_LAUNCH.splitlines()
    expected = [f"import: {path}:{i}: {line.split(':')[0]}: {LAUNCHER_NOTE}" for i, line in enumerate(lines, 1)
                if line.split(":")[0] not in read]
    assert notes_of(result) == expected  # each key once, in the file's order, nothing else
    assert result.json["job"]["cluster"] == {"nodes": 2, "gpus_per_node": 8}
    # accelerate's own loader takes every key (ClusterConfig refuses unknown ones, from_yaml_file).
    pytest.importorskip("accelerate", reason="accelerate is in the `interop` extra")
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(path).rdzv_backend == "c10d"


def test_accelerate_use_cpu_says_shardplan_has_no_cpu_setting(write):
    """`accelerate config` writes use_cpu: true for MULTI_CPU (accelerate/commands/config/cluster.py)."""
    text = "distributed_type: MULTI_CPU\nnum_processes: 4\nuse_cpu: true\n"
    path = write("acc.yaml", text)
    result = run_cli("import", path, "--set", "model.preset=tiny-gpt2", "--json")
    assert result.code == 0, result.err
    assert notes_of(result) == [f"import: {path}:3: use_cpu: {CPU_NOTE}"]
    assert result.json["job"]["zero"]["stage"] == 0 and result.json["job"]["parallel"]["dp"] == 4


def test_accelerate_deepspeed_launcher_is_named(write):
    text = "distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 2\n" \
           "  deepspeed_multinode_launcher: standard\n"
    path = write("acc.yaml", text)
    result = run_cli("import", path, "--set", "model.preset=llama-3-8b")
    assert result.code == 0, result.err
    assert f"import: {path}:5: deepspeed_config.deepspeed_multinode_launcher: {LAUNCHER_NOTE}" in result.err_lines


def test_accelerate_export_leaves_the_device_to_the_machine(write):
    """A job file says no device: `shardplan run` takes CUDA where a GPU exists, else the CPU
    with gloo (runtime/dist.py, pick_device), so the export writes use_cpu: false. true would
    not put this FSDP plan on CPUs: accelerate 1.15 hands use_cpu to the workers only through
    its simple launcher (accelerate/utils/launch.py, prepare_simple_launcher_cmd_env), and
    `accelerate launch` takes FSDP through the multi-GPU one (commands/launch.py, launch_command)."""
    pytest.importorskip("accelerate", reason="accelerate is in the `interop` extra")
    import yaml
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    out = write("acc.yaml", "")
    assert run_cli("export", "tiny-gpt2-cpu", "--to", "accelerate", "-o", out).code == 0
    with open(out, encoding="utf-8") as file:
        config = yaml.safe_load(file)
    assert (config["use_cpu"], config["distributed_type"], config["num_processes"]) == (False, "FSDP", 2)
    for use_cpu in (False, True):
        path = write(f"cpu-{use_cpu}.yaml", yaml.safe_dump({**config, "use_cpu": use_cpu}))
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
        assert (args.use_fsdp, args.use_cpu, args.cpu) == (True, use_cpu, False)
        env = prepare_multi_gpu_env(args)
        assert env["ACCELERATE_USE_FSDP"] == "true" and "ACCELERATE_USE_CPU" not in env


# -- mistyped and conflicting values an import refuses in one line ----------------------------

@pytest.mark.parametrize("name, text, needle", [
    # torchtitan's [model] name and flavor are strings (torchtitan/config/job_config.py, Model);
    # a list or a table is named, not looked up as a preset.
    ("flavor.toml", '[parallelism]\ndata_parallel_shard_degree = 8\n[model]\nname = "llama3"\nflavor = []\n',
     "flavor.toml:5: model.flavor: expected a string, got []"),
    ("name.toml", '[parallelism]\ndata_parallel_shard_degree = 8\n[model]\nname = {a = 1}\nflavor = "8B"\n',
     "name.toml:4: model.name: expected a string"),
    # YAML reads 2:, true: and null: as a number, a boolean and nothing: accelerate's keys are names.
    ("number.yaml", "distributed_type: FSDP\n2: 3\nnum_processes: 8\n",
     "number.yaml:2: 2: a key must be a name, and YAML reads '2' as a number (quote it)"),
    ("bool.yaml", "distributed_type: FSDP\nfsdp_config:\n  true: 5\nnum_processes: 8\n",
     "bool.yaml:3: fsdp_config.true: a key must be a name, and YAML reads 'true' as a boolean"),
    ("surrogate.yaml", 'distributed_type: FSDP\nnum_processes: "\\ud800"\n',
     "surrogate.yaml: num_processes: not valid Unicode: YAML's escape leaves an unpaired surrogate"),
    # DeepSpeed's learning rate (deepspeed/runtime/config.py reads it as the optimizer's own
    # param) must be positive; JSON's NaN and a negative rate are refused, not dropped.
    ("nan.json", '{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": NaN}}}',
     "nan.json:1: optimizer.params.lr: must be a positive number (got nan)"),
    ("negative.json", '{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": -1}}}',
     "negative.json:1: optimizer.params.lr: must be a positive number (got -1.0)"),
])
def test_import_refuses_in_one_line(write, name, text, needle):
    result = run_cli("import", write(name, text), "--dp", "8")
    assert result.code == 2, (result.code, result.err)
    assert result.err_lines == [needle] or needle in result.err_lines[0], result.err
    assert "Traceback" not in result.err and "internal error" not in result.err


def test_deepspeed_zero_learning_rate_is_said_not_carried(write):
    # lr 0 is a config whose scheduler sets the rate (WarmupLR's warmup_min_lr): not planned as 0.
    result = run_cli("import", write("zero.json", '{"train_micro_batch_size_per_gpu": 1, "optimizer": '
                                                  '{"type": "AdamW", "params": {"lr": 0}}}'), "--dp", "8")
    assert result.code == 0, result.err
    assert "optimizer.params.lr: 0 is not carried (train.lr must be > 0)" in result.err
    assert "lr =" not in result.out


TITAN_DP8 = """[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
global_batch_size = 8
[parallelism]
data_parallel_shard_degree = 8
"""


def test_torchtitan_shard_degree_against_the_command_line(write):
    """A shard degree the config gives decides dp, as in torchtitan's ParallelDims; a --dp or
    --world that makes another dp is refused (as the DeepSpeed import refuses a --dp its
    train_batch_size contradicts), not taken silently with another global batch."""
    path = write("titan.toml", TITAN_DP8)
    assert run_cli("import", path, "--dp", "8").code == 0
    result = run_cli("import", path, "--dp", "4")
    assert result.code == 2
    assert result.err_lines == [f"{path}:8: parallelism.data_parallel_shard_degree: replicate 1 x shard 8 makes dp 8, "
                                "but --dp 4"]
    result = run_cli("import", path, "--world", "4")
    assert result.code == 2 and "makes dp 8, but --world 4 / tp x pp x cp 1 makes dp 4" in result.err


def test_yaml_aliases_are_walked_once(write, monkeypatch):
    """YAML's aliases make one list many times over ("billion laughs": 343 bytes, 9^9 strings
    once expanded); PyYAML builds each alias as the same object, and the check for unpaired
    surrogates walks each object once: a string is looked at once, not once per reference."""
    import shardplan.io.files as files

    lines = ["distributed_type: FSDP", "num_processes: 8", 'a: &a ["x","x","x","x","x","x","x","x","x"]']
    for previous, name in zip("abcde", "bcdef"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
    looked = []
    real = files._has_surrogate
    monkeypatch.setattr(files, "_has_surrogate", lambda text: looked.append(text) or real(text))
    result = run_cli("import", write("bomb.yaml", "\n".join(lines) + "\n"), "--dp", "8")
    assert result.code == 0, result.err
    assert 0 < len(looked) < 100  # 9 strings and the keys; expanded, 9^6 = 531,441 strings


# -- torchtitan before 0.2: the names its published train_configs use ----------------------------
# Copied verbatim into tests/data/interop/ from pytorch/torchtitan: train_configs/llama3_70b.toml at
# 2db26cf34 (2024-04) and train_configs/llama3_8b.toml at db6b39acd (2024-09). The renames are those of
# torchtitan/config_manager.py's history: batch_size -> local_batch_size (8570415c3), [training] and
# [experimental] degrees -> [parallelism] (785c34c99), data_parallel_degree -> data_parallel_shard_degree
# (db6b39acd).
OLD_DATA = os.path.join(os.path.dirname(__file__), "data", "interop")


def test_torchtitan_2024_config_reads_its_degrees_and_batch():
    """llama3_70b.toml of April 2024: `batch_size = 8` (line 29), `data_parallel_degree = -1` (34),
    `tensor_parallel_degree = 8  # 8-way TP` (35), `pipeline_parallel_degree = 1` (36). They were
    "not read: no effect on the plan" and the job was dp 64 x tp 1; over 64 GPUs it is tp 8 x dp 8."""
    path = os.path.join(OLD_DATA, "torchtitan_llama3_70b_2024-04.toml")
    result = run_cli("import", path, "--world", "64", "--json")
    assert result.code == 0, result.err
    par = result.json["job"]["parallel"]
    assert (par["dp"], par["tp"], par["pp"], par["micro_batch_size"]) == (8, 8, 1, 8)
    notes = {(n["line"], n["path"]): n["message"] for n in result.json["notes"]}
    assert notes[(29, "training.batch_size")] == ("the name before torchtitan commit 8570415c3 (torchtitan 0.2 "
                                                  "refuses it): read as training.local_batch_size")
    assert notes[(35, "training.tensor_parallel_degree")].endswith("read as parallelism.tensor_parallel_degree")
    assert notes[(34, "training.data_parallel_degree")].startswith("the name before torchtitan commit db6b39acd")


def test_torchtitan_2024_config_round_trips_under_todays_names(write):
    """The September 2024 llama3_8b.toml (`batch_size = 1` line 29, HSDP degrees in [training],
    `[experimental] pipeline_parallel_degree = 1` line 41): micro batch 1 (was torchtitan 0.2's
    default 8), and the export writes them as 0.2's [parallelism] and local_batch_size."""
    path = os.path.join(OLD_DATA, "torchtitan_llama3_8b_2024-09.toml")
    job = write("job.toml", "")
    result = run_cli("import", path, "--world", "8", "-o", job)
    assert result.code == 0, result.err
    assert f"{path}:41: experimental.pipeline_parallel_degree: the name before torchtitan commit 785c34c99" in result.err
    config = run_cli("export", job, "--to", "torchtitan", "--json").json["config"]
    assert config["training"]["local_batch_size"] == 1
    assert (config["parallelism"]["data_parallel_shard_degree"], config["parallelism"]["tensor_parallel_degree"],
            config["parallelism"]["pipeline_parallel_degree"]) == (8, 1, 1)


def test_torchtitan_2025_experimental_keys_are_each_named():
    """torchtitan's llama3_405b.toml at a30d4cca6 (2025-03-17, the day before 785c34c99), copied
    verbatim: [experimental] (line 44) holds two degrees, which are read under today's names, and
    `enable_async_tensor_parallel = true` (line 47), which 785c34c99 moved to [parallelism] and
    shardplan does not read: that key is named, not the table."""
    path = os.path.join(OLD_DATA, "torchtitan_llama3_405b_2025-03.toml")
    result = run_cli("import", path, "--world", "128", "--json")
    assert result.code == 0, result.err
    notes = {(n["line"], n["path"]): n["message"] for n in result.json["notes"]}
    assert not any(path == "experimental" for _, path in notes)
    assert notes[(47, "experimental.enable_async_tensor_parallel")].startswith(
        "not read: shardplan has no setting for it (torchtitan commit 785c34c99 moved it to "
        "parallelism.enable_async_tensor_parallel")
    assert notes[(46, "experimental.pipeline_parallel_degree")].endswith("read as parallelism.pipeline_parallel_degree")
    par = result.json["job"]["parallel"]
    assert (par["dp"], par["tp"], par["pp"], par["cp"]) == (16, 8, 1, 1)  # data_parallel_shard_degree -1 over 128


def test_torchtitan_old_and_new_name_together_reads_the_new(write):
    """No torchtitan reads both names (each release defines one); 0.2 reads today's, so that one
    wins and the old one is named as not read, whatever it says."""
    path = write("tt.toml", "[training]\nbatch_size = 4\nlocal_batch_size = 2\ntensor_parallel_degree = 4\n"
                            "[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 4\n")
    result = run_cli("import", path, "--json")
    assert result.code == 0, result.err
    par = result.json["job"]["parallel"]
    assert (par["tp"], par["micro_batch_size"]) == (2, 2)
    notes = {n["path"]: n["message"] for n in result.json["notes"]}
    assert notes["training.batch_size"] == ("not read: torchtitan commit 8570415c3 renamed it training.local_batch_size, "
                                            "and training.local_batch_size is given and read instead")
    assert notes["training.tensor_parallel_degree"].startswith("not read: torchtitan commit 785c34c99 renamed it")


def test_torchtitan_old_pipeline_keys(write):
    """[experimental] pipeline keys of torchtitan before 785c34c99: `pipeline_parallel_split_points`
    names the first layer of every stage but the first (its help text at 57387af0e:
    "layers.0,layers.2" makes 3 stages) and `pipeline_parallel_microbatches` the number of
    microbatches (local batch / microbatches each; 5e2033c75 replaced it with the size)."""
    path = write("tt.toml", '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nbatch_size = 8\n'
                            "data_parallel_shard_degree = 1\n[experimental]\npipeline_parallel_degree = 2\n"
                            'pipeline_parallel_schedule = "1F1B"\npipeline_parallel_split_points = ["layers.12"]\n'
                            "pipeline_parallel_microbatches = 4\n")
    result = run_cli("import", path, "--json")
    assert result.code == 0, result.err
    par = result.json["job"]["parallel"]
    # Llama-3 8B has 32 layers (meta-llama/Meta-Llama-3-8B config.json num_hidden_layers): 12 + 20.
    assert (par["pp"], par["micro_batch_size"], par["num_microbatches"]) == (2, 2, 4)
    assert (par["first_stage_layers"], par["last_stage_layers"]) == (12, 20)


def test_torchtitan_ddp_type_of_2024(write):
    """`data_parallel_type = "ddp"` (torchtitan 2f989b9f3 to db6b39acd) replicated the model."""
    path = write("tt.toml", '[training]\ndata_parallel_degree = 4\ndata_parallel_type = "ddp"\n')
    result = run_cli("import", path, "--json")
    assert result.code == 0, result.err
    assert (result.json["job"]["parallel"]["dp"], result.json["job"]["zero"]["stage"]) == (4, 0)


@pytest.mark.parametrize("target", ("deepspeed", "torchtitan", "accelerate", "megatron"))
def test_export_of_a_qlora_plan_says_what_the_config_trains(target):
    """None of the four formats has a LoRA setting: the exported config describes the base
    model's training, which without adapters (peft, in the training script) is a full fine-tune
    of bf16 weights; the note says so instead of only that the adapters are dropped."""
    result = run_cli("export", "llama-3-70b-qlora", "--to", target, "--json")
    assert result.code == 0, result.err
    lora = [note["message"] for note in result.json["notes"] if note["path"] == "lora"]
    assert lora == [f"{target} has no LoRA setting: the adapters are not exported; unless the training script adds "
                    "them (peft), a run of this config trains every parameter (a full fine-tune, its weights not in "
                    "NF4), which needs far more memory than this plan's estimate"]


@pytest.mark.parametrize("name, text, said", [
    ("ds.json", '{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}',
     "a DeepSpeed config, not a shardplan job: `shardplan import {path} -o job.toml` turns it into one"),
    ("titan.toml", '[job]\ndump_folder = "out"\n[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\n'
                   'data_parallel_shard_degree = 8\n',
     "a torchtitan config, not a shardplan job: `shardplan import {path} -o job.toml` turns it into one"),
    ("acc.yaml", "distributed_type: FSDP\nnum_processes: 8\n",
     "a YAML file, not a shardplan job (TOML): `shardplan import {path} -o job.toml` reads an accelerate config"),
    ("train.sh", "#!/bin/bash\ntorchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32\n",
     "a shell script, not a shardplan job (TOML): command-line arguments are not imported; `shardplan import` "
     "reads a DeepSpeed JSON, a torchtitan TOML or an accelerate YAML config"),
    ("launch", "#!/bin/bash\ntorchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32\n",
     "a shell script, not a shardplan job (TOML): command-line arguments are not imported; `shardplan import` "
     "reads a DeepSpeed JSON, a torchtitan TOML or an accelerate YAML config"),
])
@pytest.mark.parametrize("command", [("export", "--to", "deepspeed"), ("estimate",), ("validate",)])
def test_another_frameworks_config_where_a_job_goes_points_to_import(write, name, text, said, command):
    """A config `import` reads (io/interop/source.py `detect`), given where a job file goes, is
    one line naming its framework and the import, not each of its keys called unknown."""
    path = write(name, text)
    result = run_cli(command[0], path, *command[1:])
    assert result.code == 2 and result.err_lines == [f"{path}: {said.format(path=path)}"], result.err


def test_strict_export_exits_1_when_a_note_says_the_config_fails(tmp_path):
    """`export` writes the config it was asked for and exits 0 whatever its notes say; with
    --strict a script gets exit 1 when a note says a run of the written config fails: the
    target refuses it outright (DeepSpeed's pipeline engine at ZeRO 2, tests/test_interop_deepspeed.py
    checks the rule against DeepSpeed's code) or it runs out of memory as written (torchtitan
    cannot offload on one data-parallel rank, docs/interop.md). The file is written either way;
    a note that asks something of the training script (a PipelineModule) is no failure."""
    qlora = str(ROOT / "presets/jobs/llama-3-70b-qlora.toml")
    one_gpu = ("--dp", "1", "--set", "cluster.gpus_per_node=1", "--set", "lora.base_dtype=bf16")
    out = tmp_path / "tt.toml"
    for strict, code in (((), 0), (("--strict",), 1)):
        out.unlink(missing_ok=True)
        result = run_cli("export", qlora, *one_gpu, "--to", "torchtitan", "-o", str(out), *strict)
        assert result.code == code and out.exists(), (strict, result.err)
        assert "as written, a run stops out of memory" in result.err
    fits = run_cli("export", qlora, *one_gpu, "--to", "deepspeed", "-o", str(tmp_path / "ds.json"), "--strict")
    assert fits.code == 0, fits.err
    result = run_cli("export", "llama-2-70b-3d", "--to", "deepspeed", "--set", "zero.stage=2", "--strict", "--json")
    assert result.code == 1
    failing = {n["path"]: n["fails"] for n in result.json["notes"]}
    assert failing["zero.stage"] is True and failing["parallel.pp"] is False, failing
    assert sum(failing.values()) == 1
    assert run_cli("export", "llama-2-70b-3d", "--to", "deepspeed", "--strict").code == 0
