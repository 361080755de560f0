"""Every environment variable the proxy reads goes through settings' env helpers, with one
policy: a value that is not what it must be stops the process at start, naming the variable
(gpuproxy/settings.py). Each reader is checked in a fresh interpreter, as a start would be."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("name", "value", "says"), [
    ("GPUPROXY_ACTIVITY_BUFFER", "lots", "GPUPROXY_ACTIVITY_BUFFER='lots' is not an integer"),
    ("GPUPROXY_ACTIVITY_BUFFER", "0", "GPUPROXY_ACTIVITY_BUFFER='0' must be at least 1"),
    ("GPUPROXY_RELOAD_SECONDS", "soon", "GPUPROXY_RELOAD_SECONDS='soon' is not a number"),
    ("GPUPROXY_STREAM_KEEPALIVE_SECONDS", "nan",
     "GPUPROXY_STREAM_KEEPALIVE_SECONDS='nan' must be a finite number"),
])
def test_a_bad_value_stops_the_start_and_names_the_variable(name, value, says):
    code = "import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'gpuproxy.settings'; " \
           "django.setup()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", name: value}, timeout=60)
    assert out.returncode != 0
    assert says in out.stderr


def test_the_readers_take_the_settings_values(settings):
    from activity.writer import ActivityWriter

    settings.GPUPROXY_ACTIVITY_BUFFER = 7
    assert ActivityWriter().max_buffer == 7
