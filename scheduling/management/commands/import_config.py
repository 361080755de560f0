"""`gpuproxy import_config PATH [--dry-run] [--force]`: make the database match a llama-swap
config file, or a directory of them (`-config-dir`)."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduling.importer import import_path
from scheduling.llamaswap import ConfigError


class Command(BaseCommand):
    help = ("Import a llama-swap config.yaml (or a directory of *.yml/*.yaml files, merged as "
            "llama-swap's -config-dir does): afterwards the models, groups, settings, API "
            "keys, matrix sets, peers, selectors and profiles in the database are exactly "
            "those of the file. Unsupported sections are "
            "named in warnings. Nothing changes when the file has an error, or when it is "
            "unchanged since the last import (unless --force).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="the llama-swap config.yaml, or a directory of them")
        parser.add_argument("--dry-run", action="store_true",
                            help="print the changes the import would make, then change "
                                 "nothing")
        parser.add_argument("--force", action="store_true",
                            help="import even when the file is unchanged since the last "
                                 "import (replacing edits made in the admin since)")

    def handle(self, *args: object, file: str, dry_run: bool = False, force: bool = False,
               **options: object) -> None:
        path = Path(file)
        try:
            report = import_path(path, force=force, dry_run=dry_run)
        except FileNotFoundError:
            raise CommandError(f"config file not found: {path}; pass the path of a llama-swap "
                               "config.yaml or of a directory of them") from None
        except ConfigError as exc:
            raise CommandError(f"{path}: {exc}; nothing was changed") from None
        for warning in report.warnings:
            self.stderr.write(f"warning: {warning}")
        self.stdout.write(report.summary(str(path)))
        if dry_run and not report.unchanged:
            self.stdout.write("changes it would make:" if report.changes else
                              "no changes: the database already matches the file")
            for line in report.changes:
                self.stdout.write(f"  {line}")
