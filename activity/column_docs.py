"""`docs/activity.md`'s column tables, rendered from `activity/columns.py` and the models.

The file keeps each table between two markers; `rewrite` replaces what is between them, so the
prose around the tables stays hand-written. The type column comes from the model field, in
PostgreSQL's words (a test checks them against the real catalog).
"""

from __future__ import annotations

import re
from pathlib import Path

from django.apps import apps
from django.db import models

from activity.columns import TABLES, Table

DOC = Path(__file__).resolve().parent.parent / "docs" / "activity.md"
END = "<!-- end of generated columns -->"

# PostgreSQL's short names; format_type's long ones in the comments (tests compare them)
_TYPES = {
    "AutoField": "integer",
    "BigAutoField": "bigint",
    "BigIntegerField": "bigint",
    "BinaryField": "bytea",  # bytea
    "BooleanField": "boolean",
    "DateTimeField": "timestamptz",  # timestamp with time zone
    "FloatField": "float",  # double precision
    "GenericIPAddressField": "inet",
    "IntegerField": "integer",
    "JSONField": "jsonb",
    "SmallIntegerField": "smallint",
    "TextField": "text",
    "UUIDField": "uuid",
}


def begin(table: Table) -> str:
    return (f"<!-- columns of {table.name}: generated from activity/columns.py by "
            f"`gpuproxy activity_columns --write`; edit them there -->")


def doc_type(field: models.Field) -> str:
    kind = field.get_internal_type()
    if kind == "CharField":
        return f"varchar({field.max_length})"
    return _TYPES[kind]


def _model(table: Table) -> type[models.Model]:
    for model in apps.get_app_config("activity").get_models():
        if model._meta.db_table == table.name:
            return model
    raise LookupError(f"no activity model has the table {table.name}")


def render(table: Table) -> str:
    """The Markdown table: column, type (and unit), meaning, NULL when."""
    fields = {field.column: field for field in _model(table)._meta.concrete_fields}
    lines = ["| column | type | meaning | NULL when |", "|---|---|---|---|"]
    for column in table.columns:
        kind = doc_type(fields[column.name]) + (f", {column.unit}" if column.unit else "")
        lines.append(f"| `{column.name}` | {kind} | {column.meaning} | {column.null} |")
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """`text` (the doc) with every marked table replaced by its rendering; a missing marker is
    an error, so a table cannot silently drop out of the docs."""
    for table in TABLES:
        start = begin(table)
        pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(END), re.S)
        if not pattern.search(text):
            raise LookupError(f"{DOC.name} has no block `{start}` ... `{END}` for {table.name}")
        block = f"{start}\n{render(table)}\n{END}"
        text = pattern.sub(lambda _match: block, text)  # noqa: B023 (used at once)
    return text
