"""`shardplan layout`: the CONTRACT JSON, the picture, `--rank`, and bad input (exit 2)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from shardplan.core.layout import GROUP_NAMES

RANK_KEYS = ["rank", "node", "local_rank", "dp", "tp", "pp", "cp", "pp_prev", "pp_next", "first_stage", "last_stage"]


def test_json_document_contract():
    result = run_cli("layout", "--dp", "2", "--tp", "4", "--pp", "2", "--json")
    assert result.code == 0, result.err
    doc = result.json
    assert list(doc)[:4] == ["schema_version", "world_size", "order", "gpus_per_node"]
    assert (doc["schema_version"], doc["world_size"], doc["order"], doc["gpus_per_node"]) == (1, 16, "tp-cp-dp-pp", 8)
    assert [list(r) for r in doc["ranks"]] == [RANK_KEYS] * 16
    assert doc["ranks"][13] == {
        "rank": 13, "node": 1, "local_rank": 5, "dp": 1, "tp": 1, "pp": 1, "cp": 0,
        "pp_prev": 5, "pp_next": None, "first_stage": False, "last_stage": True,
    }
    assert list(doc["groups"]) == list(GROUP_NAMES)
    assert doc["groups"]["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert doc["groups"]["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert doc["groups"]["pp"] == [[r, r + 8] for r in range(8)]
    assert doc["groups"]["cp"] == [[r] for r in range(16)]
    assert doc["warnings"] == []


def test_json_one_rank_per_line():
    result = run_cli("layout", "--dp", "3", "--json")
    rank_lines = [line for line in result.out.splitlines() if line.lstrip().startswith('{"rank"')]
    assert len(rank_lines) == 3


def test_warnings_in_json_and_on_stderr():
    result = run_cli("layout", "--dp", "8", "--tp", "2", "--order", "dp-tp", "--json")
    assert result.code == 0
    assert result.json["warnings"][0].startswith("tp group [0, 8] spans nodes 0 and 1")
    assert result.json["order"] == "dp-tp-cp-pp"
    assert "warning: tp group [0, 8] spans nodes 0 and 1" in result.err


def test_gpus_per_node_from_flag_and_from_job(write):
    result = run_cli("layout", "--dp", "4", "--gpus-per-node", "2", "--json")
    assert [r["node"] for r in result.json["ranks"]] == [0, 0, 1, 1]
    job = write("job.toml", "[parallel]\ndp = 6\norder = \"dp-tp\"\n[cluster]\ngpus_per_node = 3\nnodes = 2\n")
    doc = run_cli("layout", job, "--json").json
    assert (doc["gpus_per_node"], doc["order"]) == (3, "dp-tp-cp-pp")
    assert [r["local_rank"] for r in doc["ranks"]] == [0, 1, 2, 0, 1, 2]


def test_preset_job():
    doc = run_cli("layout", "llama-2-70b-3d", "--json").json
    assert (doc["world_size"], doc["gpus_per_node"], doc["warnings"]) == (64, 8, [])
    assert all(len({r // 8 for r in g}) == 1 for g in doc["groups"]["tp"])


def test_rank_document():
    result = run_cli("layout", "--dp", "2", "--tp", "4", "--pp", "2", "--rank", "13", "--json")
    assert result.code == 0, result.err
    doc = result.json
    assert doc["rank"] == {
        "rank": 13, "node": 1, "local_rank": 5, "dp": 1, "tp": 1, "pp": 1, "cp": 0,
        "pp_prev": 5, "pp_next": None, "first_stage": False, "last_stage": True,
    }
    assert doc["groups"]["dp"] == [9, 13]
    assert doc["groups"]["tp"] == [12, 13, 14, 15]
    assert doc["groups"]["pp"] == [5, 13]
    assert doc["groups"]["embedding"] == [5, 13]
    assert doc["groups"]["mp"] == [4, 5, 6, 7, 12, 13, 14, 15]


def test_picture():
    result = run_cli("layout", "--dp", "2", "--tp", "4", "--pp", "2", "--gpus-per-node", "8")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0] == "world 16 = dp 2 x tp 4 x pp 2 x cp 1, order tp-cp-dp-pp (tp fastest), 2 nodes of 8 GPUs"
    assert "node 0  r0 p0   r1 p0   r2 p0   r3 p0   r4 p0   r5 p0   r6 p0   r7 p0" in lines
    assert "        d0 t0   d0 t1   d0 t2   d0 t3   d1 t0   d1 t1   d1 t2   d1 t3" in lines
    assert any(line.startswith("node 1  r8 p1") for line in lines)
    assert any(line.split()[:3] == ["tp", "4", "x"] for line in lines)


def test_picture_of_a_huge_world_is_short():
    result = run_cli("layout", "--dp", "64", "--tp", "8", "--pp", "32")
    assert result.code == 0
    assert "... 2044 more nodes (ranks 32-16383)" in result.out
    assert len(result.out.splitlines()) < 40
    assert "... 2044 more" in next(line for line in result.out.splitlines() if line.strip().startswith("tp "))


def test_picture_shows_cp_when_used():
    result = run_cli("layout", "--cp", "2", "--tp", "2")
    assert "d0 t1 c1" in result.out


def test_schedule_problems_do_not_block_a_layout():
    """pp 2 with the default single microbatch cannot run 1f1b, but ranks sit where they sit."""
    result = run_cli("layout", "--pp", "2", "--json")
    assert result.code == 0
    assert "warning: parallel.num_microbatches: 1f1b needs at least pp (2) microbatches" in result.err
    assert result.json["world_size"] == 2


@pytest.mark.parametrize("args, needle", [
    (["--rank", "16", "--dp", "16"], "--rank: rank 16 is out of range: the world has ranks 0..15"),
    (["--rank", "-1"], "rank -1 is out of range"),
    (["--order", "tp-tp"], "--order tp-tp: parallel.order: axis 'tp' appears twice"),
    (["--order", "tp-ep"], "unknown axis 'ep'"),
    (["--pp", "2", "--order", "tp-dp"], "--order tp-dp: parallel.order: 'tp-dp' leaves out pp, whose degree is 2"),
    (["--dp", "0"], "--dp 0: parallel.dp: must be >= 1"),
    (["--tp", "-2"], "parallel.tp: must be >= 1"),
    (["--gpus-per-node", "0"], "cluster.gpus_per_node: must be >= 1"),
    (["--dp", "2", "--world", "3"], "!= world size 3 (from --world)"),
    (["--rank", "x"], "--rank"),
    (["no-such-job"], "no such file or job preset"),
])
def test_bad_input(args, needle):
    result = run_cli("layout", *args)
    assert result.code == 2, (result.out, result.err)
    assert "Traceback" not in result.err
    assert any(needle in line for line in result.err_lines), result.err
    assert result.out == ""


def test_bad_job_file_blocks(write):
    result = run_cli("layout", write("job.toml", "[parallel]\ntp = 3\n[model]\npreset = \"llama-3-8b\"\n"))
    assert result.code == 2
    assert "parallel.tp: 3 does not divide model.num_heads (32)" in result.err


def test_json_is_valid_for_a_big_world():
    result = run_cli("layout", "--dp", "16", "--tp", "8", "--pp", "4", "--cp", "2", "--json")
    doc = json.loads(result.out)
    assert len(doc["ranks"]) == 1024
    assert sorted(r for g in doc["groups"]["dp_cp"] for r in g) == list(range(1024))


def test_json_writer_round_trips_awkward_values():
    """The one-call fast path is only taken for rows of numbers; strings that look like item
    separators go through the per-item path and survive."""
    from shardplan.render.output import dumps_document

    document = {
        "rows": [{"a": 1, "b": None, "c": True}, {"a": 2, "b": 3.5, "c": False}],
        "names": [{"name": "}, {"}, {"name": "], ["}],
        "lists": [[1, 2], [3]],
        "mixed": [["x", 1], [2]],
        "empty": [],
        "nested": {"inner": [[0]]},
    }
    assert json.loads(dumps_document(document)) == {"schema_version": 1, **document}


def test_model_errors_still_block(write):
    write("config.json", '{"model_type": "bert", "hidden_size": 8}')
    result = run_cli("layout", write("job.toml", '[model]\nhf_config = "config.json"\n'))
    assert result.code == 2
    assert "model_type: 'bert' is not supported" in result.err


def test_schedule_problem_in_a_file_is_a_located_warning(write):
    path = write("job.toml", "[parallel]\npp = 4\nnum_microbatches = 2\n")
    result = run_cli("layout", path, "--json")
    assert result.code == 0
    assert f"{path}:3: warning: parallel.num_microbatches: 1f1b needs at least pp (4) microbatches" in result.err
