"""`gpuproxy export_config [-o FILE]`: write the database as a llama-swap config.yaml."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduling.exporter import export_document


class Command(BaseCommand):
    help = ("Write the models, groups, settings and API keys as llama-swap YAML (with "
            "gpuproxy's extensions); `import_config` of the output recreates the same state. "
            "Macros and ${env.…} references of the last import are written as they were; a "
            "key whose value is not stored is written as a commented placeholder, with a "
            "warning.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("-o", "--output", metavar="FILE",
                            help="write to FILE instead of standard output")

    def handle(self, *args: object, output: str | None = None, **options: object) -> None:
        document = export_document()
        for warning in document.warnings:
            self.stderr.write(f"warning: {warning}")
        if not output:
            self.stdout.write(document.text, ending="")
            return
        path = Path(output)
        try:
            path.write_text(document.text, encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror}; check that the "
                               "directory exists and is writable") from None
        self.stderr.write(f"wrote {path}")
