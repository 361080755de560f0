"""The priority range an API key (or, for keys without one, the proxy settings) allows.

A caller's `X-LlamaSwap-Priority` is self-declared: without a range any key holder may claim
int64-max and starve everyone. One abstract model gives `ApiKey` and `ProxySettings` the same
three columns and the same checks, so the admin and an import refuse the same ranges with the
same words (docs/scheduling.md, "Trusted priority").
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models

_INT64 = (-(2**63), 2**63 - 1)


class PriorityRange(models.Model):
    """`priority_min`/`priority_max` bound the applied priority (empty: no bound on that side);
    `priority_default` is what a request that asks for none gets (empty: the global default,
    else 0)."""

    priority_min = models.BigIntegerField(
        "priority min", null=True, blank=True,
        help_text="The lowest priority applied (a lower X-LlamaSwap-Priority is raised to it); "
                  "empty = no lower bound. On a key: `priority: {min}` under apiKeyHashes.")
    priority_max = models.BigIntegerField(
        "priority max", null=True, blank=True,
        help_text="The highest priority applied (a higher one asked is lowered to it, e.g. "
                  "-50 keeps a batch tenant in the batch band); empty = no upper bound.")
    priority_default = models.BigIntegerField(
        "priority default", null=True, blank=True,
        help_text="The priority of a request that asks for none (no header, no service_tier); "
                  "empty = the global default, else 0. Must lie within min..max.")

    class Meta:
        abstract = True

    def priority_range_errors(self) -> dict[str, str]:
        """The range's faults by field, for `clean()` (an empty dict: none)."""
        lo, hi, default = self.priority_min, self.priority_max, self.priority_default
        errors: dict[str, str] = {}
        for name, value in (("priority_min", lo), ("priority_max", hi),
                            ("priority_default", default)):
            if value is not None and not _INT64[0] <= value <= _INT64[1]:
                errors[name] = "A priority must fit a signed 64-bit integer."
        if errors:
            return errors
        if lo is not None and hi is not None and lo > hi:
            errors["priority_max"] = (
                f"priority max ({hi}) is below priority min ({lo}): no priority would fit; "
                "swap them or leave one empty.")
        elif default is not None and ((lo is not None and default < lo)
                                      or (hi is not None and default > hi)):
            errors["priority_default"] = (
                f"priority default ({default}) lies outside min..max "
                f"({'' if lo is None else lo}..{'' if hi is None else hi}); a request asking "
                "for nothing would be clamped anyway: set it inside the range.")
        return errors

    def clean(self) -> None:
        errors = self.priority_range_errors()
        if errors:
            raise ValidationError(errors)

    def priority_range(self) -> tuple[int | None, int | None, int | None]:
        """(min, max, default) as the catalog carries them."""
        return (self.priority_min, self.priority_max, self.priority_default)
