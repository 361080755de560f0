"""`ConfigImport`, the last import of a config file, and who may import one in a fleet.

Beside scheduling/models.py (which re-exports it) because that module is at its size limit.
"""

from __future__ import annotations

from django.db import models


class ConfigImport(models.Model):
    """The last import of a config file (or `-config-dir`): a single row.

    Startup compares the file's content hash with `content_hash` and imports only when it
    changed, so edits made in the admin survive a restart with an unchanged file. The admin
    reads `managed` to say which rows the file will overwrite; the export reads `meaning` to
    write back the macros, `${env.…}` references and entries the database has no column for.
    """

    source_path = models.TextField(help_text="The file or directory last imported.")
    files = models.JSONField(default=list, help_text="The files it was read from, in order.")
    content_hash = models.CharField(
        max_length=64, help_text="SHA-256 of the files and the environment values they use.")
    imported_at = models.DateTimeField()
    managed = models.JSONField(
        default=dict, help_text="What the file defines: model ids, group ids, settings.")
    meaning = models.JSONField(
        default=dict, help_text="What the export needs to write the file back as written: "
                                "the source text of values that used macros or ${env.…}, "
                                "and entries naming no model. Never a secret's value.")

    class Meta:
        verbose_name = "config import"

    def __str__(self) -> str:
        return f"{self.source_path} ({self.imported_at:%Y-%m-%d %H:%M:%S})"

    def save(self, *args, **kwargs) -> None:
        self.pk = 1
        super().save(*args, **kwargs)

    @classmethod
    def last(cls) -> ConfigImport | None:
        return cls.objects.filter(pk=1).first()
