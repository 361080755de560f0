"""The pure modules must import without Django or asyncio (the brief's dependency rule)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["scheduling.core.swapper", "scheduling.llamaswap",
                                    "scheduling.spec", "scheduling.catalog", "scheduling.core.fifo",
                                    "scheduling.core.priority", "scheduling.core.serial",
                                    "scheduling.core.stats", "scheduling.core.handover",
                                    "scheduling.core.policies", "scheduling.core.ledger",
                                    "scheduling.slots"])
def test_pure_module_imports_without_django(module):
    code = (f"import sys, {module}; "
            "bad = [m for m in ('django', 'asyncio') if m in sys.modules]; "
            "print(','.join(bad))")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=str(__import__("pathlib").Path(__file__).parents[1]),
                         check=True)
    assert out.stdout.strip() == ""
