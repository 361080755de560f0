"""`score_parts` may carry `"budget_override": true` (issue 23, the affinity budget): its comment
says so. Written as 0010 is: Django's state takes the AlterField, the database gets only a
`COMMENT ON` (an AlterField would re-set the column's type on the partitioned table for
nothing); undoing it puts 0010's text back. SQLite has no comments.
"""

from django.db import migrations, models

OLD = ('the score\'s breakdown: {"priority", "affinity", "aging", "seq"} (seq = arrival '
       'sequence); NULL when not dispatched')
HELP = ('the score\'s breakdown: {"priority", "affinity", "aging", "seq"} (seq = arrival '
        'sequence), and "budget_override": true when the affinity budget gave the model its '
        'affinity (serial: a request of it had lost picks to affinity for the budget)')
NEW = HELP + '; NULL when not dispatched'


def comment(text):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor != "postgresql":
            return
        meta = apps.get_model("activity", "requestlog")._meta
        column = meta.get_field("score_parts").column
        schema_editor.execute(
            f"COMMENT ON COLUMN {schema_editor.quote_name(meta.db_table)}."
            f"{schema_editor.quote_name(column)} IS {schema_editor.quote_value(text)}")
    return run


class Migration(migrations.Migration):

    dependencies = [
        ('activity', '0010_column_comments'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='requestlog',
                    name='score_parts',
                    field=models.JSONField(blank=True, db_comment=NEW, help_text=HELP,
                                           null=True),
                ),
            ],
            database_operations=[migrations.RunPython(comment(NEW), comment(OLD))],
        ),
    ]
