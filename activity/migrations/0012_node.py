"""`node` on both activity tables (issue 24: the GPUPROXY_NODE that wrote the row) and an
index (node, time) for the admin's node filter.

Not atomic on PostgreSQL: each statement commits on its own, so the ACCESS EXCLUSIVE lock of an ADD COLUMN
is held for that statement only, not for the index builds after it (in one transaction it
would block every read of the log until the last index was built). Each statement waits at
most `LOCK_TIMEOUT` for its lock (behind a long analyst query, say) and otherwise fails,
having changed nothing more than the statements before it; running `migrate` again goes on.

PostgreSQL: ADD COLUMN with a constant default changes only the catalog (no rewrite), on the
partitioned parent and every partition at once; existing rows read ''. The indexes are built
on every partition (CREATE INDEX on a partitioned table cannot be CONCURRENTLY) under a SHARE
lock: reads go on, the writers wait and buffer, for as long as the build: measured on 1M rows
in three monthly partitions (2 CPU cores), 8 ms for the column and 0.77 s for the index.
SQLite rebuilds both tables, as for any NOT NULL column (300k rows: about 6 s), and so loses
the time index 0001 made outside Django's state (it had already lost it to 0003's rebuild):
it is made again.
"""

from django.db import connection, migrations, models

TIME_INDEX = "activity_rl_received_at"  # 0001's


LOCK_TIMEOUT = "30s"


def lock_timeout(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")


def no_lock_timeout(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("RESET lock_timeout")


def sqlite_time_index(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {TIME_INDEX} ON activity_requestlog (received_at)")


class Migration(migrations.Migration):

    # PostgreSQL: statement by statement (above). SQLite rebuilds the tables, which must stay
    # in one transaction: a crash halfway would lose a table.
    atomic = connection.vendor != "postgresql"

    dependencies = [
        ('activity', '0011_score_parts_budget_override'),
    ]

    operations = [
        migrations.RunPython(lock_timeout, no_lock_timeout),
        migrations.AddField(
            model_name='modelevent',
            name='node',
            field=models.CharField(blank=True, db_comment="the node whose process it was: its GPUPROXY_NODE (indexed with at); '' on rows older than 0012, or written by another client", db_default='', default='', help_text='the node whose process it was: its GPUPROXY_NODE (indexed with at)', max_length=63),
        ),
        migrations.AddField(
            model_name='requestlog',
            name='node',
            field=models.CharField(blank=True, db_comment="the node that served the request: its GPUPROXY_NODE (default the host name; indexed with received_at); '' on rows older than 0012, or written by another client", db_default='', default='', help_text='the node that served the request: its GPUPROXY_NODE (default the host name; indexed with received_at)', max_length=63),
        ),
        migrations.AddIndex(
            model_name='modelevent',
            index=models.Index(fields=['node', 'at'], name='activity_me_node_time'),
        ),
        migrations.AddIndex(
            model_name='requestlog',
            index=models.Index(fields=['node', 'received_at'], name='activity_rl_node_time'),
        ),
        migrations.RunPython(sqlite_time_index, migrations.RunPython.noop),
        migrations.RunPython(no_lock_timeout, lock_timeout),
    ]
