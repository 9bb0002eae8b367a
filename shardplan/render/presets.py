"""Preset listings."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..spec.units import format_count


def preset_table(rows: list[dict]) -> Table:
    table = Table(title="shipped presets", title_justify="left", show_lines=False)
    table.add_column("kind")
    table.add_column("name", style="bold")
    table.add_column("params", justify="right")
    table.add_column("description")
    for row in rows:
        params = format_count(row["params"]["total"]) if row["params"] else ""
        table.add_row(row["kind"], row["name"], params, row["description"])
    return table


def preset_detail(doc: dict, text: str) -> Group:
    from rich.syntax import Syntax  # pygments: only for showing one preset, not the list

    parts = [Text(f"{doc['kind']} preset {doc['name']}: {doc['file']}", style="bold")]
    if doc["params"]:
        p = doc["params"]
        line = f"parameters: {p['total']:,} (embedding {p['embedding']:,}"
        line += f", active per token {p['active']:,})" if p["active"] != p["total"] else ")"
        parts.append(Text(line))
    parts.append(Syntax(text, "toml", theme="ansi_dark", background_color="default"))
    return Group(*parts)
