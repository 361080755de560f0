"""`parallel` empty = read from the command (scheduling/slots.py); concurrencyLimit's unset
value now depends on the scheduler.

Until now an unset `parallel` was stored as 1, the default, and a written 1 looked the same.
The stored 1s become empty, so they follow the command: a llama-server started with `-np 2`
gets its two slots. A config that wrote `parallel: 1` writes it again at its next import,
and going back restores 1 everywhere it is empty.
"""

from django.db import migrations, models


def ones_follow_the_command(apps, schema_editor):
    apps.get_model("scheduling", "ModelDefinition").objects.filter(parallel=1).update(
        parallel=None)


def empty_is_one_again(apps, schema_editor):
    apps.get_model("scheduling", "ModelDefinition").objects.filter(parallel=None).update(
        parallel=1)


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0006_queue_caps'),
    ]

    operations = [
        migrations.AlterField(
            model_name='modeldefinition',
            name='concurrency_limit',
            field=models.PositiveIntegerField(default=0, help_text="`concurrencyLimit`: requests admitted at once (queued + served); more get 429. 0 = not set: under serial no cap of its own (the queue caps in the proxy settings bound it); under fifo llama-swap's 10."),
        ),
        migrations.AlterField(
            model_name='modeldefinition',
            name='parallel',
            field=models.PositiveIntegerField(blank=True, help_text='`parallel` (gpuproxy): requests the upstream serves at once (its slots); the rest wait in the proxy, where priority orders them. Empty = read from cmd: llama-server\'s -np (without it, llama-server\'s auto: 4 slots), vLLM\'s --max-num-seqs, SGLang\'s --max-running-requests, else 1; "slots" shows the number and where it came from. At least 1 when set.', null=True),
        ),
        migrations.AlterField(
            model_name='proxysettings',
            name='max_waiting',
            field=models.PositiveIntegerField(default=20000, help_text="`queue.maxWaiting` (gpuproxy): requests that may wait at once (queued or behind a model load), all bands together; beyond it, 429 queue_full. 0 = no cap. The default lets a batch of 10,000 queue on an idle box, on one model too: under serial a model's unset concurrencyLimit adds no cap."),
        ),
        migrations.RunPython(ones_follow_the_command, empty_is_one_again),
    ]
