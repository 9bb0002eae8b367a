"""Record the Megatron-LM arguments `shardplan export --to megatron` writes, with their source.

Megatron-LM's parser is not on the package index (megatron-core ships megatron/core only), so
the tests check exported arguments against this record, made with Megatron's own parser:

    python tools/megatron_arguments.py /path/to/Megatron-LM [COMMIT] > tests/data/interop/megatron_arguments.json

It builds the parser with `megatron.training.arguments.add_megatron_arguments` (torch and
triton installed; Python 3.11 needs `typing.override`, supplied here), and for every
`--flag` that shardplan/io/interop/megatron.py can write it records where the flag is
defined (the `add_argument` line in arguments.py, or the dataclass field that
`ArgumentGroupFactory` turns into it), whether it takes a value, and its choices.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

EXPORTER = Path(__file__).resolve().parent.parent / "shardplan" / "io" / "interop" / "megatron.py"


def main() -> None:
    checkout = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(checkout))
    typing.override = getattr(typing, "override", lambda f: f)  # Python < 3.12
    import megatron.training.argument_utils as utils

    origin: dict[str, str] = {}
    build_group = utils.ArgumentGroupFactory.build_group

    def recording_build_group(self, parser, title=None):
        before = set(parser._option_string_actions)
        group = build_group(self, parser, title)
        for flag in set(parser._option_string_actions) - before:
            dest = parser._option_string_actions[flag].dest
            for klass in self.src_cfg_class.__mro__:
                try:
                    lines, start = inspect.getsourcelines(klass)
                    path = Path(inspect.getsourcefile(klass)).relative_to(checkout)
                except (TypeError, OSError, ValueError):
                    continue
                hit = next((i for i, text in enumerate(lines) if re.match(rf"\s+{dest}\s*:", text)), None)
                if hit is not None:
                    origin[flag] = f"{path}:{start + hit} ({klass.__name__}.{dest})"
                    break
        return group

    utils.ArgumentGroupFactory.build_group = recording_build_group
    add_argument = argparse._ActionsContainer.add_argument

    def recording_add_argument(self, *names, **kwargs):
        frame = sys._getframe(1)
        action = add_argument(self, *names, **kwargs)
        if frame.f_code.co_filename.endswith("megatron/training/arguments.py"):
            for name in names:
                origin.setdefault(name, f"megatron/training/arguments.py:{frame.f_lineno}")
        return action

    argparse._ActionsContainer.add_argument = recording_add_argument
    import megatron.training.arguments as arguments

    arguments.ArgumentGroupFactory = utils.ArgumentGroupFactory
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    wanted = sorted(set(re.findall(r'add\("(--[a-z0-9-]+)"', EXPORTER.read_text())))
    commit = sys.argv[2] if len(sys.argv) > 2 else subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"megatron_lm_commit": commit, "arguments": {}}
    for flag in wanted:
        action = parser._option_string_actions[flag]
        choices = [getattr(c, "name", c) for c in action.choices] if action.choices else None
        record["arguments"][flag] = {"source": origin[flag], "takes_value": action.nargs != 0,
                                     "choices": choices}
    json.dump(record, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
