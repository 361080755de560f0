"""`gpuproxy import_config FILE [--dry-run]`: make the database match a llama-swap config."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduling.importer import import_config, load_file
from scheduling.llamaswap import ConfigError


class Command(BaseCommand):
    help = ("Import a llama-swap config.yaml: afterwards the models, groups, settings and API "
            "keys in the database are exactly those of the file. Unsupported sections are "
            "named in warnings. Nothing changes when the file has an error.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="the llama-swap config.yaml to import")
        parser.add_argument("--dry-run", action="store_true",
                            help="check the file against the database, then change nothing")

    def handle(self, *args: object, file: str, dry_run: bool = False, **options: object) -> None:
        path = Path(file)
        if not path.is_file():
            raise CommandError(f"config file not found: {path}; pass the path of a llama-swap "
                               "config.yaml")
        try:
            report = import_config(load_file(path), dry_run=dry_run)
        except ConfigError as exc:
            raise CommandError(f"{path}: {exc}; nothing was changed") from None
        for warning in report.warnings:
            self.stderr.write(f"warning: {warning}")
        self.stdout.write(report.summary(str(path)))
