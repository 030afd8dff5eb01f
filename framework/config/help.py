"""The configuration described for people: the ``--help`` text and the docs' table, both
generated from the field docstrings, grouped by section."""

from __future__ import annotations

from .schema import FIELDS, SECTIONS, TYPES, describe_default, describe_type, field_docs


def _section_keys(section: str) -> list[str]:
    return [key for key in FIELDS if key.split(".")[0] == section]


def help_text() -> str:
    lines = []
    for section in SECTIONS:
        lines.append(f"  [{section}]")
        for key in _section_keys(section):
            kind = "true|false" if TYPES[key] is bool else describe_type(key).upper()
            f = FIELDS[key]
            was = f"; was --{f.metadata['was'].replace('_', '-')}" if f.metadata["was"] else ""
            lines.append(f"  --{key} {kind}  (default: {describe_default(key)}{was})")
            lines.append(f"      {field_docs()[key]}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """A table cell: a `|` would end the cell on GitHub, even inside a code span."""
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The configuration tables (one per section), generated from the field docstrings."""
    out = []
    for section in SECTIONS:
        out += [f"**`[{section}]`**", "",
                "| key | type | default | on resume | meaning | flat alias |",
                "| --- | --- | --- | --- | --- | --- |"]
        for key in _section_keys(section):
            f = FIELDS[key]
            default = "''" if f.default == "" else describe_default(key)
            out.append(f"| `{key}` | {_cell(describe_type(key))} | {_cell(f'`{default}`')} | "
                       f"{f.metadata['resume']} | {_cell(field_docs()[key])} | "
                       f"{'`' + f.metadata['was'] + '`' if f.metadata['was'] else 'none'} |")
        out.append("")
    return "\n".join(out[:-1])
