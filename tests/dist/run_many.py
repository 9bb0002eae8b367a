"""Run several `shardplan run` jobs in one torchrun launch: the tests pay torchrun's start-up
and torch's import once for many plans (every job needs the launch's world size).

    torchrun --nproc_per_node N tests/dist/run_many.py PLAN.json

PLAN.json lists `{"job": job file, "report": report path, "resume": null | "latest" | path}`;
each job runs as `shardplan run JOB --report REPORT [--resume ...]` would, in order.
"""

from __future__ import annotations

import gc
import json
import sys

from shardplan.cli.estimate_cmd import limits_known
from shardplan.io.job import load_job
from shardplan.runtime.capabilities import require_supported
from shardplan.runtime.dist import start, stop
from shardplan.runtime.worker import RunOptions, _train, dp_split


def main(plan_path: str) -> None:
    with open(plan_path, encoding="utf-8") as handle:
        plan = json.load(handle)
    for item in plan:
        resolved = load_job(item["job"], check_paths=True)
        require_supported(resolved)
        job = resolved.job
        runtime = start(resolved.degrees, job.parallel.order, job.cluster.gpus_per_node,
                        job.parallel.communication_timeout, dp_split=dp_split(job))
        options = RunOptions(report_path=item["report"], table=False, resume=item.get("resume"))
        _train(resolved, runtime, limits_known(resolved), options)
        gc.collect()
    stop()


if __name__ == "__main__":
    main(sys.argv[1])
