"""The analysts' tables describe themselves: every column carries its `COMMENT ON` in the real
PostgreSQL catalog, with the same text `docs/activity.md` shows, both from `activity/columns.py`."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection, models
from django.test.utils import isolate_apps

from activity import column_docs
from activity.columns import TABLES, Column, Table, described, plain

# PostgreSQL's format_type for the docs' short names (the catalog's words, typed here by hand)
CATALOG_TYPE = {
    "bigint": "bigint", "boolean": "boolean", "bytea": "bytea", "float": "double precision",
    "inet": "inet", "integer": "integer", "jsonb": "jsonb", "smallint": "smallint",
    "text": "text", "timestamptz": "timestamp with time zone", "uuid": "uuid",
}


def catalog(table: str) -> tuple[str | None, dict[str, tuple[str, str | None]]]:
    """The table's comment, and each column's (type, comment), as PostgreSQL has them."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT obj_description(%s::regclass, 'pg_class')", [table])
        (about,) = cursor.fetchone()
        cursor.execute(
            "SELECT attname, format_type(atttypid, atttypmod), col_description(attrelid, attnum)"
            " FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
            " AND NOT attisdropped", [table])
        return about, {name: (kind, comment) for name, kind, comment in cursor.fetchall()}


@pytest.mark.django_db
@pytest.mark.postgres
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_every_column_has_its_comment_in_the_catalog(table: Table) -> None:
    about, columns = catalog(table.name)
    assert about == table.comment
    # every column of the real table is described, and no description names a missing one
    assert sorted(columns) == sorted(c.name for c in table.columns)
    for column in table.columns:
        assert columns[column.name][1] == column.comment, column.name


@pytest.mark.django_db
@pytest.mark.postgres
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_the_docs_types_are_the_catalogs(table: Table) -> None:
    _, columns = catalog(table.name)
    model = column_docs._model(table)
    for field in model._meta.concrete_fields:
        short = column_docs.doc_type(field)
        wanted = (f"character varying({field.max_length})" if short.startswith("varchar(")
                  else CATALOG_TYPE[short])
        assert columns[field.column][0] == wanted, field.column


def test_the_docs_tables_are_the_modules() -> None:
    text = column_docs.DOC.read_text()
    assert column_docs.rewrite(text) == text, "run `gpuproxy activity_columns --write`"
    call_command("activity_columns", "--check")


def test_a_comment_reads_without_markdown_and_says_when_null() -> None:
    assert plain("the `model` [docs](x.md) *Token counts* **BRIN**") == \
        "the model docs Token counts BRIN"
    assert Column("a", "queue `wait`", null="not dispatched", unit="ms").comment == \
        "queue wait (unit: ms); NULL when not dispatched"
    assert Column("b", "the `model`", null="— (`''` when it did not resolve)").comment == \
        "the model; '' when it did not resolve"
    assert Column("c", "HTTP method", null="—").comment == "HTTP method"
    assert Column("d", "the priority", null="never (0 by default)").comment == \
        "the priority; never NULL (0 by default)"
    # the catalog holds the plain text: a real one, worked out by hand from columns.py
    assert TABLES[0].column("swap_ms").comment == (
        "time this request waited for a model load (swap) before it could run (unit: ms); "
        "NULL when the request waited for no load")


@isolate_apps("activity")
def test_a_column_without_a_description_is_an_error_at_import() -> None:
    table = Table("t", "about", (Column("id", "row id", null="never"),
                                 Column("gone", "a column the model lacks", null="never")))
    with pytest.raises(ImproperlyConfigured, match=r"missing \['name'\], extra \['gone'\]"):
        @described(table)
        class T(models.Model):
            id = models.BigAutoField(primary_key=True)
            name = models.CharField(max_length=5)

            class Meta:
                app_label = "activity"
                db_table = "t"


def test_check_fails_on_a_stale_doc(tmp_path, monkeypatch) -> None:
    stale = column_docs.DOC.read_text().replace(
        "| `swap_ms` | float, ms |", "| `swap_ms` | float |", 1)
    doc = tmp_path / "activity.md"
    doc.write_text(stale)
    monkeypatch.setattr(column_docs, "DOC", doc)
    with pytest.raises(CommandError, match="out of date"):
        call_command("activity_columns", "--check")
    call_command("activity_columns", "--write")
    assert doc.read_text() == column_docs.rewrite(doc.read_text())
    assert "| `swap_ms` | float, ms |" in doc.read_text()
