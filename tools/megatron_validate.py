"""Run Megatron-LM's own `parse_args` and `validate_args` on `shardplan export --to megatron`.

    shardplan export JOB --to megatron --json > args.json   # one or more, as {name: [args]}
    python tools/megatron_validate.py /path/to/Megatron-LM WORLD_SIZE args.json...

Megatron-LM's training package is not on the package index, so this runs by hand on a
checkout (torch and triton installed). `validate_args` asks the GPU for its architecture;
this machine may have none, so an H100's (9) stands in. Tensor and context parallel need
CUDA_DEVICE_MAX_CONNECTIONS=1 in the launch environment, Megatron-FSDP needs it unset: set as
Megatron's launch scripts do. A NullTokenizer with the model's vocabulary stands in for a
tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import typing
from pathlib import Path


def main() -> None:
    checkout, world, files = Path(sys.argv[1]).resolve(), int(sys.argv[2]), sys.argv[3:]
    sys.path.insert(0, str(checkout))
    typing.override = getattr(typing, "override", lambda f: f)  # Python < 3.12
    import megatron.training.arguments as arguments

    arguments.get_device_arch_version = lambda: 9
    failed = 0
    for name in files:
        document = json.loads(Path(name).read_text())
        args = document["config"]["args"] if "config" in document else document
        parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        namespace = parser.parse_args(args + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"])
        namespace.world_size, namespace.rank = world, 0
        if (namespace.tensor_model_parallel_size > 1 or namespace.context_parallel_size > 1) \
                and not namespace.use_megatron_fsdp:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        else:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                arguments.validate_args(namespace, {})
        except AssertionError as exc:
            failed += 1
            print(f"{name}: validate_args failed: {exc}")
            continue
        print(f"{name}: validate_args ok (data_parallel_size {namespace.data_parallel_size}, "
              f"virtual stages {namespace.virtual_pipeline_model_parallel_size})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
