"""Forwarding between nodes (issue 24, item 4a): `url` on `activity_node` (where the other
nodes reach this one) and `entry_node` on `activity_requestlog` (the node a forwarded request
entered by). Both ADD COLUMN with a constant default: on PostgreSQL a catalog change only (the
partitioned parent and its partitions at once, no rewrite), each statement waiting at most
0012's `LOCK_TIMEOUT` for its lock, as 0012 does and for the same reason. SQLite rebuilds
activity_requestlog for the NOT NULL column and so drops the time index 0001 made outside
Django's state: it is made again, as in 0012.
"""

from django.db import connection, migrations, models

LOCK_TIMEOUT = "30s"
TIME_INDEX = "activity_rl_received_at"  # 0001's


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

    atomic = connection.vendor != "postgresql"

    dependencies = [
        ('activity', '0014_node_heartbeat_comment'),
    ]

    operations = [
        migrations.RunPython(lock_timeout, no_lock_timeout),
        migrations.AddField(
            model_name='node',
            name='url',
            field=models.CharField(blank=True, db_comment="where the other nodes reach this one to forward a request to it: GPUPROXY_ADVERTISE, else derived from --listen; '' on rows older than 0015: never forwarded to", db_default='', default='', help_text='where the other nodes reach this one to forward a request to it: GPUPROXY_ADVERTISE, else derived from --listen', max_length=255),
        ),
        migrations.AddField(
            model_name='requestlog',
            name='entry_node',
            field=models.CharField(blank=True, db_comment='the node the request entered the fleet by, when another node forwarded it here (docs/fleet.md, "Forwarding between nodes"); node served it; \'\': it entered here, or the row is older than 0015', db_default='', default='', help_text='the node the request entered the fleet by, when another node forwarded it here (docs/fleet.md, "Forwarding between nodes"); node served it', max_length=63),
        ),
        migrations.RunPython(no_lock_timeout, lock_timeout),
        migrations.RunPython(sqlite_time_index, migrations.RunPython.noop),
    ]
