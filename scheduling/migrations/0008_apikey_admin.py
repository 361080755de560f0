"""`ApiKey.admin`: admin keys reach the management API, /logs, /upstream/… and the commands in
/running; other keys get inference (docs/security.md, "Who can do what").

Every key could do all of that until now, and deployments rely on it (scripts that unload,
tail logs, read /running): the keys that exist keep it, so an upgrade takes nothing away. Keys
made from now on are not admin unless marked; an import that does not say keeps what a key
has (scheduling/importer.py).
"""

from django.db import migrations, models


def existing_keys_stay_admin(apps, schema_editor):
    apps.get_model("scheduling", "ApiKey").objects.update(admin=True)


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0007_parallel_derived_from_cmd'),
    ]

    operations = [
        migrations.AddField(
            model_name='apikey',
            name='admin',
            field=models.BooleanField(default=False, help_text="Admin keys may also use the management API (load, unload, /api/queue, /api/activity), /logs, /upstream/… and see each model's command in /running. Other keys get inference, /v1/models, /metrics and /running without commands. (`admin: true` under apiKeyHashes in a config.)"),
        ),
        migrations.RunPython(existing_keys_stay_admin, migrations.RunPython.noop),
    ]
