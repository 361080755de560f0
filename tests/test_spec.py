"""Command-line splitting: llama-swap's multi-line cmd, never a shell."""

import pytest

from scheduling.spec import UpstreamSpec, split_command


def test_multiline_cmd_with_comments_and_continuations():
    cmd = """
    llama-server --port 9001
      # a comment line that must vanish
      -m "/models/my model.gguf" \\
      --ctx-size 4096
    """
    assert split_command(cmd) == [
        "llama-server", "--port", "9001", "-m", "/models/my model.gguf", "--ctx-size", "4096"]


def test_shell_metacharacters_stay_literal():
    assert split_command("echo hi; rm -rf / && $(x)") == ["echo", "hi;", "rm", "-rf", "/",
                                                          "&&", "$(x)"]


@pytest.mark.parametrize(("cmd", "fragment"), [
    ("", "empty"),
    ("# only a comment", "empty"),
    ("llama-server --port ${PORT}", "${PORT}"),
    ('llama-server -m "unclosed', "quotation"),
])
def test_bad_commands_say_why(cmd, fragment):
    with pytest.raises(ValueError, match=None) as info:
        split_command(cmd)
    assert fragment.lower() in str(info.value).lower()


def test_health_url():
    spec = UpstreamSpec("m", "x", "http://127.0.0.1:5800/", check_endpoint="health")
    assert spec.health_url() == "http://127.0.0.1:5800/health"
    none = UpstreamSpec("m", "x", "http://127.0.0.1:5800", check_endpoint="none")
    assert none.health_url() is None
