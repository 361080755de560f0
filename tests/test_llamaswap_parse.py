"""The pure llama-swap parser: macros, env, ports, groups, errors and warnings (no database).

Expected values are written out by hand from the YAML in each test, never computed with the
code under test.
"""

from __future__ import annotations

import textwrap

import pytest

from scheduling.llamaswap import (
    ConfigError,
    ParsedConfig,
    ParsedModel,
    format_go_duration,
    parse_config,
    parse_go_duration,
)
from tests.llamaswap_fixture import FIXTURE_ENV, fixture_text


def parse(yaml_text: str, env: dict[str, str] | None = None) -> ParsedConfig:
    return parse_config(textwrap.dedent(yaml_text), env or {})


def model(parsed: ParsedConfig, model_id: str) -> ParsedModel:
    return next(m for m in parsed.models if m.model_id == model_id)


def error(yaml_text: str, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(yaml_text, env)
    return info.value


def warned_paths(parsed: ParsedConfig) -> set[str]:
    return {w.split(": ", 1)[0] for w in parsed.warnings}


# --- the fixture (tests/data/llama-swap-config.yaml) ----------------------------------------


def test_fixture_warns_about_exactly_what_gpuproxy_does_not_honour():
    """Every warned key the fixture holds, read off the file by hand, and nothing else."""
    parsed = parse_config(fixture_text(), FIXTURE_ENV)
    assert warned_paths(parsed) == {
        "healthCheckTimeout", "logLevel", "logTimeFormat", "logToStdout", "logRequests",
        "metricsMaxInMemory", "store", "ui", "upstream.ignorePaths",
        "apiKeys[2]",
        "models.llama-8b.filters.setParams.model", "models.qwen-coder.timeouts",
        "models.qwen-coder.compat", "models.embed.healthCheckTimeout", "models.whisper.colour",
        "hooks.on_startup.preload[1]",
        "routing.scheduler.settings.serial.swapAffinityBonus",
    }, parsed.warnings


def test_fixture_needs_every_env_variable_it_references_outside_comments():
    for name, path in [("OPENROUTER_KEY", "peers.openrouter.apiKey"), ("MODELS", "macros.gguf"),
                       ("CI_KEY", "apiKeys[1]"), ("HF_TOKEN", "models.whisper.env[0]")]:
        env = {k: v for k, v in FIXTURE_ENV.items() if k != name}
        with pytest.raises(ConfigError) as info:
            parse_config(fixture_text(), env)
        assert info.value.path == path
        assert f"{name} is not set" in str(info.value)
    # `${env.NOT_SET_ANYWHERE}` appears only in a comment of the fixture: it is not required.
    assert "${env.NOT_SET_ANYWHERE}" in fixture_text()


# --- macros ------------------------------------------------------------------------------


def test_model_macros_override_global_ones_and_model_id_is_filled_in():
    parsed = parse("""
        macros:
          ctx: 4096
          server: /opt/llama-server
        models:
          small:
            cmd: ${server} --ctx ${ctx} --alias ${MODEL_ID}
          big:
            macros:
              ctx: 32768
            cmd: ${server} --ctx ${ctx}
            name: "${MODEL_ID} (long context)"
        """)
    assert model(parsed, "small").cmd == "/opt/llama-server --ctx 4096 --alias small"
    assert model(parsed, "big").cmd == "/opt/llama-server --ctx 32768"
    assert model(parsed, "big").name == "big (long context)"


def test_a_macro_may_use_macros_defined_above_it():
    parsed = parse("""
        macros:
          ctx: 8192
          args: "--ctx-size ${ctx} -ngl 99"
          full: "${args} --flash-attn"
        models:
          m:
            macros:
              ctx: 2048
            cmd: server ${full}
        """)
    # The model's ctx replaces the global one in place, so args and full see 2048.
    assert model(parsed, "m").cmd == "server --ctx-size 2048 -ngl 99 --flash-attn"


def test_a_macro_using_one_defined_below_it_is_an_error_that_says_to_move_it():
    err = error("""
        macros:
          args: "--ctx ${ctx}"
          ctx: 8192
        models:
          m:
            cmd: server ${args}
        """)
    assert err.path == "models.m.cmd"
    assert "${ctx}" in str(err) and "move `ctx` above" in str(err)


def test_a_macro_referring_to_itself_is_an_error():
    err = error("""
        macros:
          loop: "a ${loop}"
        models:
          m: {cmd: server}
        """)
    assert err.path == "macros.loop"
    assert "itself" in err.message


@pytest.mark.parametrize("name", ["PID", "PORT", "MODEL_ID"])
def test_reserved_macro_names_are_errors(name):
    err = error(f"""
        models:
          m:
            macros:
              {name}: "1"
            cmd: server
        """)
    assert err.path == f"models.m.macros.{name}"
    assert "reserved" in err.message


@pytest.mark.parametrize(("name", "ok"), [("a" * 63, True), ("a" * 64, False),
                                          ("has.dot", False), ("dash-and_under9", True)])
def test_macro_names_are_checked(name, ok):
    text = f"""
        macros:
          {name}: x
        models:
          m: {{cmd: server}}
        """
    if ok:
        parse(text)
    else:
        assert error(text).path == f"macros.{name}"


def test_macro_values_must_be_scalars():
    err = error("""
        macros:
          lst: [1, 2]
        models:
          m: {cmd: server}
        """)
    assert err.path == "macros.lst"
    assert "string, number or boolean" in err.message


def test_unresolved_macro_names_the_key_and_where_to_define_it():
    err = error("""
        models:
          llama-8B:
            cmd: server --x ${FOO}
        """)
    assert str(err) == ("models.llama-8B.cmd: unresolved macro ${FOO}; define it under "
                        "macros: or models.llama-8B.macros:")


def test_unresolved_macro_in_metadata_names_the_nested_path():
    err = error("""
        models:
          m:
            cmd: server
            metadata:
              deep: {list: [1, "${nope}"]}
        """)
    assert err.path == "models.m.metadata.deep.list[1]"


def test_metadata_keeps_macro_types_and_strings_format_them_like_llama_swap():
    parsed = parse("""
        macros:
          temp: 0.7
          big: 1000000.0
          flag: true
          n: 8
        models:
          m:
            cmd: server --port ${PORT}
            metadata:
              temp: ${temp}
              flag: ${flag}
              n: ${n}
              port: ${PORT}
              text: "t=${temp} b=${big} f=${flag} n=${n} p=${PORT}"
              nested: ["${temp}", {"k": "${MODEL_ID}"}]
        """)
    meta = model(parsed, "m").metadata
    assert meta["temp"] == 0.7 and isinstance(meta["temp"], float)
    assert meta["flag"] is True
    assert meta["n"] == 8 and isinstance(meta["n"], int)
    assert meta["port"] == 5800 and isinstance(meta["port"], int)
    assert meta["text"] == "t=0.7 b=1e+06 f=true n=8 p=5800"
    assert meta["nested"] == [0.7, {"k": "m"}]


# --- ${env.X} ------------------------------------------------------------------------------


def test_env_variables_are_substituted_and_comments_are_skipped():
    parsed = parse("""
        # ${env.ONLY_IN_A_COMMENT} must not be required
        macros:
          dir: "${env.MODELS}/gguf"   # trailing ${env.ALSO_A_COMMENT}
        models:
          m:
            cmd: server -m ${dir}/a.gguf
            env: ["TOKEN=${env.TOKEN}"]
        """, {"MODELS": "/srv/models", "TOKEN": 'ab"c'})
    m = model(parsed, "m")
    assert m.cmd == "server -m /srv/models/gguf/a.gguf"
    assert m.env == ('TOKEN=ab"c',)  # the quote was escaped for the double-quoted scalar


def test_unset_env_variable_names_the_variable_and_the_key():
    err = error("""
        models:
          m:
            cmd: server
            env:
              - "HF_TOKEN=${env.HF_TOKEN}"
        """)
    assert err.path == "models.m.env[0]"
    assert "HF_TOKEN is not set" in err.message


def test_env_values_with_line_breaks_are_refused():
    err = error("""
        models:
          m: {cmd: "server ${env.X}"}
        """, {"X": "a\nb"})
    assert err.path == "models.m.cmd"
    assert "line break" in err.message


def test_env_can_supply_numbers():
    parsed = parse("""
        globalTTL: ${env.TTL}
        models: {}
        """, {"TTL": "300"})
    assert parsed.settings.global_ttl == 300


# --- ${PORT}, ${PID}, proxy ------------------------------------------------------------------


def test_ports_go_in_sorted_id_order_only_to_models_whose_cmd_uses_port():
    parsed = parse("""
        startPort: 9000
        macros:
          srv: "server --port ${PORT}"
        models:
          zeta:  {cmd: "server --port ${PORT}"}
          alpha: {cmd: "${srv}"}
          beta:  {cmd: "server --port 7000", proxy: "http://127.0.0.1:7000"}
          gamma: {cmd: "server --port=${PORT}", proxy: "http://10.0.0.2:${PORT}/v1"}
        """)
    assert model(parsed, "alpha").port == 9000
    assert model(parsed, "alpha").cmd == "server --port 9000"
    assert model(parsed, "alpha").proxy == "http://localhost:9000"
    assert model(parsed, "beta").port is None
    assert model(parsed, "gamma").port == 9001
    assert model(parsed, "gamma").proxy == "http://10.0.0.2:9001/v1"
    assert model(parsed, "zeta").port == 9002


def test_proxy_using_port_while_cmd_does_not_is_an_error():
    err = error("""
        models:
          m:
            cmd: server --port 8080
            proxy: http://127.0.0.1:${PORT}
        """)
    assert err.path == "models.m.proxy"
    assert "${PORT}" in err.message and "cmd" in err.message


def test_default_proxy_without_port_in_cmd_is_kept_with_a_warning():
    parsed = parse("""
        models:
          m: {cmd: some-server}
        """)
    assert model(parsed, "m").proxy == "http://localhost:${PORT}"
    assert model(parsed, "m").port is None
    assert "models.m.proxy" in warned_paths(parsed)


def test_pid_is_kept_in_cmd_stop():
    parsed = parse("""
        models:
          m:
            cmd: server --port ${PORT}
            cmdStop: "stopper --pid ${PID} --port ${PORT}"
        """)
    assert model(parsed, "m").cmd_stop == "stopper --pid ${PID} --port 5800"


@pytest.mark.parametrize(("entry", "path"), [
    ('{cmd: "server --pid ${PID}"}', "models.m.cmd"),
    ('{cmd: server, name: "x ${PID}"}', "models.m.name"),
])
def test_pid_elsewhere_is_an_error(entry, path):
    err = error(f"models:\n  m: {entry}\n")
    assert err.path == path
    assert "only available in cmdStop" in err.message


# --- cmd text --------------------------------------------------------------------------------


def test_multi_line_cmd_becomes_one_command_line_without_comments():
    parsed = parse("""
        models:
          m:
            cmd: |
              # the server
              /opt/llama-server \\
                --model /m/a.gguf
              # --flash-attn  (off for now)
              --ctx-size 4096
        """)
    assert model(parsed, "m").cmd == "/opt/llama-server --model /m/a.gguf --ctx-size 4096"


def test_cmd_with_an_unbalanced_quote_is_an_error():
    err = error("""
        models:
          m: {cmd: "server --prompt 'oops"}
        """)
    assert err.path == "models.m.cmd"
    assert "quote" in err.message


def test_missing_cmd_is_an_error():
    assert error("models:\n  m: {name: x}\n").path == "models.m.cmd"


# --- model fields ------------------------------------------------------------------------------


def test_model_defaults_and_gpuproxy_extensions():
    parsed = parse("""
        models:
          plain: {cmd: server}
          tuned:
            cmd: server
            concurrencyLimit: 0
            parallel: 4
            enabled: false
            sendLoadingState: true
            ttl: 0
        """)
    plain, tuned = model(parsed, "plain"), model(parsed, "tuned")
    # parallel not written stays None: the importer derives it from cmd (scheduling/slots.py)
    assert (plain.ttl, plain.parallel, plain.enabled, plain.concurrency_limit) == (-1, None,
                                                                                   True, 0)
    assert plain.send_loading_state is None
    assert plain.check_endpoint == "/health"
    assert (tuned.parallel, tuned.enabled, tuned.send_loading_state, tuned.ttl) == (4, False,
                                                                                    True, 0)


@pytest.mark.parametrize(("snippet", "path"), [
    ('ttl: "abc"', "models.m.ttl"),
    ("ttl: -5", "models.m.ttl"),
    ("parallel: 0", "models.m.parallel"),
    ("concurrencyLimit: -1", "models.m.concurrencyLimit"),
    ("unlisted: maybe", "models.m.unlisted"),
    ("aliases: one", "models.m.aliases"),
    ("env: [NOEQUALS]", "models.m.env[0]"),
    ("proxy: 127.0.0.1:80", "models.m.proxy"),
    ("capabilities: {in: [smell]}", "models.m.capabilities.in[0]"),
    ("metadata: {x: .nan}", "models.m.metadata.x"),
    ("filters: {setParamsByID: {v: 3}}", "models.m.filters.setParamsByID.v"),
])
def test_type_errors_name_the_path(snippet, path):
    err = error(f"""
        models:
          m:
            cmd: server
            {snippet}
        """)
    assert err.path == path, str(err)


def test_filters_and_set_params_by_id_keys_become_aliases():
    parsed = parse("""
        models:
          qwen:
            cmd: server
            aliases: [q]
            filters:
              stripParams: "temperature, top_p"
              setParams: {top_k: 20}
              setParamsByID:
                "${MODEL_ID}": {think: true}
                "${MODEL_ID}:fast": {think: false}
                q: {x: 1}
        """)
    qwen = model(parsed, "qwen")
    assert qwen.aliases == ("q", "qwen:fast")
    assert qwen.strip_params == "temperature, top_p"
    assert qwen.set_params == {"top_k": 20}
    assert qwen.set_params_by_id == {"qwen": {"think": True}, "qwen:fast": {"think": False},
                                     "q": {"x": 1}}


def test_legacy_strip_params_spelling_is_read():
    parsed = parse("""
        models:
          m:
            cmd: server
            filters: {strip_params: "seed"}
        """)
    assert model(parsed, "m").strip_params == "seed"


@pytest.mark.parametrize(("models", "path"), [
    ("a: {cmd: s, aliases: [x]}\n  b: {cmd: s, aliases: [x]}", "models.b.aliases[0]"),
    ("a: {cmd: s, aliases: [b]}\n  b: {cmd: s}", "models.a.aliases[0]"),
    ("a: {cmd: s, aliases: [x]}\n  b: {cmd: s, filters: {setParamsByID: {x: {k: 1}}}}",
     "models.b.filters.setParamsByID.x"),
    ("a: {cmd: s, filters: {setParamsByID: {b: {k: 1}}}}\n  b: {cmd: s}",
     "models.a.filters.setParamsByID.b"),
])
def test_duplicate_aliases_are_errors(models, path):
    err = error(f"models:\n  {models}\n")
    assert err.path == path, str(err)


# --- groups and routing ----------------------------------------------------------------------


def test_top_level_groups():
    parsed = parse("""
        models:
          a: {cmd: s}
          b: {cmd: s}
          c: {cmd: s}
        groups:
          pair:
            swap: false
            exclusive: false
            members: [a, b]
          always:
            persistent: true
            members: [c]
        """)
    pair, always = parsed.groups
    assert (pair.group_id, pair.swap, pair.exclusive, pair.persistent) == ("pair", False,
                                                                           False, False)
    assert pair.members == ("a", "b")
    assert (always.swap, always.exclusive, always.persistent) == (True, True, True)
    assert [model(parsed, x).group for x in "abc"] == ["pair", "pair", "always"]


def test_routing_router_groups():
    parsed = parse("""
        models:
          a: {cmd: s}
          b: {cmd: s}
        routing:
          router:
            use: group
            settings:
              groups:
                g: {members: [b]}
        """)
    assert [g.group_id for g in parsed.groups] == ["g"]
    assert model(parsed, "a").group is None
    assert model(parsed, "b").group == "g"


def test_both_group_forms_together_are_an_error():
    err = error("""
        models:
          a: {cmd: s}
        groups:
          g1: {members: [a]}
        routing:
          router:
            settings:
              groups:
                g2: {members: []}
        """)
    assert err.path == "groups"
    assert "routing.router" in err.message


def test_a_model_in_two_groups_is_an_error_naming_both():
    err = error("""
        models:
          a: {cmd: s}
        groups:
          g1: {members: [a]}
          g2: {members: [a]}
        """)
    assert err.path == "groups.g2.members[0]"
    assert "'g1'" in err.message


def test_unknown_group_member_is_skipped_with_a_warning():
    # llama-swap's own example lists illustrative members that it never defines; gpuproxy
    # must import that example, so an unknown member warns instead of failing.
    parsed = parse("""
        models:
          a: {cmd: s}
        groups:
          g: {members: [a, ghost]}
        """)
    assert parsed.groups[0].members == ("a",)
    assert "groups.g.members[1]" in warned_paths(parsed)


def test_matrix_router_is_read_without_a_warning():
    parsed = parse("""
        models:
          a: {cmd: s}
          b: {cmd: s}
        routing:
          router:
            use: matrix
            settings:
              matrix: {sets: {s1: "a & b"}}
        """)
    assert parsed.groups == ()
    assert (parsed.settings.router, parsed.matrix_sets) == ("matrix", (("s1", "a & b"),))
    assert not any("matrix" in w for w in parsed.warnings), parsed.warnings


def test_top_level_matrix_is_the_matrix_router():
    parsed = parse("""
        models:
          a: {cmd: s}
        matrix:
          sets: {s1: "a"}
        """)
    assert (parsed.settings.router, parsed.matrix_sets) == ("matrix", (("s1", "a"),))
    assert not any("matrix" in w for w in parsed.warnings), parsed.warnings


def test_scheduler_defaults_to_serial():
    assert parse("models: {}\n").settings.scheduler == "serial"


def test_scheduler_settings_and_fifo_priorities():
    parsed = parse("""
        models:
          a: {cmd: s, aliases: [alpha]}
          b: {cmd: s}
        routing:
          scheduler:
            use: fifo
            settings:
              fifo:
                priority: {alpha: 10, b: -3}
              serial:
                agingDivisor: 30
                swapAffinityBonus: 25
        """)
    s = parsed.settings
    assert (s.scheduler, s.aging_divisor, s.swap_affinity_bonus) == ("fifo", 30.0, 25)
    assert (model(parsed, "a").fifo_priority, model(parsed, "b").fifo_priority) == (10, -3)


def test_unknown_scheduler_is_an_error():
    err = error("""
        models: {}
        routing: {scheduler: {use: lottery}}
        """)
    assert err.path == "routing.scheduler.use"


def test_swap_affinity_bonus_is_capped_at_99_with_a_warning():
    parsed = parse("""
        models: {}
        routing: {scheduler: {settings: {serial: {swapAffinityBonus: 150}}}}
        """)
    assert parsed.settings.swap_affinity_bonus == 99
    assert "routing.scheduler.settings.serial.swapAffinityBonus" in warned_paths(parsed)


@pytest.mark.parametrize(("snippet", "path"), [
    ("agingDivisor: 0", "routing.scheduler.settings.serial.agingDivisor"),
    ("agingDivisor: -2.5", "routing.scheduler.settings.serial.agingDivisor"),
    ("agingDivisor: soon", "routing.scheduler.settings.serial.agingDivisor"),
    ("swapAffinityBonus: -1", "routing.scheduler.settings.serial.swapAffinityBonus"),
])
def test_bad_serial_settings_are_errors(snippet, path):
    err = error(f"""
        models: {{}}
        routing:
          scheduler:
            settings:
              serial:
                {snippet}
        """)
    assert err.path == path


# --- global settings ------------------------------------------------------------------------


def test_health_check_timeout_below_15_is_clamped_with_a_warning():
    parsed = parse("healthCheckTimeout: 5\nmodels: {}\n")
    assert parsed.settings.health_check_timeout == 15
    assert "healthCheckTimeout" in warned_paths(parsed)


def test_global_settings_and_unload_timeout_zero_means_ten():
    parsed = parse("""
        healthCheckTimeout: 300
        globalTTL: 600
        unloadTimeout: 0
        startPort: 6000
        sendLoadingState: true
        includeAliasesInList: true
        performance: {disabled: true}
        models: {}
        """)
    s = parsed.settings
    assert (s.health_check_timeout, s.global_ttl, s.unload_timeout, s.start_port) == (
        300, 600, 10, 6000)
    assert (s.send_loading_state, s.include_aliases_in_list, s.performance_monitoring) == (
        True, True, False)


def test_fixture_performance_every_is_read():
    assert parse_config(fixture_text(), FIXTURE_ENV).settings.performance_interval == 90.0  # 1m30s


@pytest.mark.parametrize(("every", "seconds"), [
    (None, 5.0),  # llama-swap's default
    ("15s", 15.0),
    ("1m30s", 90.0),
    ("1.5h", 5400.0),
    ("2.5s", 2.5),
    ("1500ms", 1.5),
    ("1s", 1.0),
])
def test_performance_every_is_a_go_duration(every, seconds):
    text = "models: {}\n" if every is None else f"performance: {{every: {every}}}\nmodels: {{}}\n"
    parsed = parse(text)
    assert parsed.settings.performance_interval == seconds
    assert "performance.every" not in warned_paths(parsed)


@pytest.mark.parametrize(("every", "fragment"), [
    ("500ms", "at least 1s"),
    ("0s", "at least 1s"),
    ("-5s", "at least 1s"),
    ("15", "add the unit"),  # an integer; Go would read it as 15 nanoseconds
    ("fast", "such as 15s"),
    ("15 s", "such as 15s"),
    ("1d", "such as 15s"),
])
def test_bad_performance_every_is_an_error_naming_the_key(every, fragment):
    err = error(f"performance: {{every: {every}}}\nmodels: {{}}\n")
    assert err.path == "performance.every"
    assert fragment in str(err), str(err)


@pytest.mark.parametrize(("seconds", "text"), [
    (5.0, "5s"), (90.0, "90s"), (2.5, "2.5s"), (1.1, "1.1s"), (86400.0, "86400s")])
def test_format_go_duration_reads_back_as_the_same_float(seconds, text):
    assert format_go_duration(seconds) == text
    assert parse_go_duration(text) == seconds


@pytest.mark.parametrize(("text", "seconds"), [
    ("0", 0.0), ("1h2m3.5s", 3723.5), (".5s", 0.5), ("1.s", 1.0), ("+4s", 4.0), ("-1m", -60.0),
    ("250us", 0.00025), ("250\u00b5s", 0.00025), ("7ns", 7e-9)])
def test_parse_go_duration_follows_time_parse_duration(text, seconds):
    assert parse_go_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1", "s", ".s", "1e3s", "-", "1h 2m", "9999999999999h"])
def test_parse_go_duration_refuses_what_go_refuses(text):
    with pytest.raises(ValueError):
        parse_go_duration(text)


@pytest.mark.parametrize(("snippet", "path"), [
    ("globalTTL: -1", "globalTTL"),
    ('startPort: "x"', "startPort"),
    ("startPort: 70000", "startPort"),
    ("sendLoadingState: 1", "sendLoadingState"),
])
def test_bad_global_settings_are_errors(snippet, path):
    assert error(f"{snippet}\nmodels: {{}}\n").path == path


def test_preload_resolves_aliases_and_warns_about_unknown_names():
    parsed = parse("""
        models:
          a: {cmd: s, aliases: [alpha]}
        hooks:
          on_startup:
            preload: [alpha, nobody]
        """)
    assert parsed.settings.preload == ("a",)
    assert "hooks.on_startup.preload[1]" in warned_paths(parsed)


def test_models_key_is_required():
    assert error("globalTTL: 5\n").path == "models"


def test_duplicate_keys_are_errors():
    err = error("""
        models:
          a: {cmd: s}
          a: {cmd: t}
        """)
    assert err.path == "models.a"
    assert "twice" in err.message


def test_yaml_syntax_errors_name_the_line():
    err = error("models:\n  a: {cmd: s\n")
    assert err.path.startswith("line ")
    assert "not valid YAML" in err.message


def test_yaml_1_2_scalars_like_go():
    parsed = parse("""
        models:
          m:
            cmd: s
            metadata: {a: on, b: 010, c: "1:30", d: 2024-01-01, e: 0x10}
        """)
    assert model(parsed, "m").metadata == {"a": "on", "b": 10, "c": "1:30", "d": "2024-01-01",
                                           "e": 16}


# --- api keys ----------------------------------------------------------------------------


def test_api_keys_and_hashes():
    digest = "ab" * 32
    parsed = parse(f"""
        apiKeys: [sk-one, sk-two, sk-one]
        apiKeyHashes:
          - {{name: ci, sha256: "{digest.upper()}"}}
        models: {{}}
        """)
    assert parsed.api_keys == ("sk-one", "sk-two")
    assert [(k.name, k.sha256) for k in parsed.api_key_hashes] == [("ci", digest)]
    assert "apiKeys[2]" in warned_paths(parsed)
    assert "sk-one" not in repr(parsed)


@pytest.mark.parametrize(("snippet", "path"), [
    ('apiKeys: ["has space"]', "apiKeys[0]"),
    ('apiKeys: [""]', "apiKeys[0]"),
    ("apiKeyHashes: [{name: x, sha256: abc}]", "apiKeyHashes[0].sha256"),
    ("apiKeyHashes: [{sha256: " + "a" * 64 + "}]", "apiKeyHashes[0].name"),
])
def test_bad_api_keys_are_errors(snippet, path):
    assert error(f"{snippet}\nmodels: {{}}\n").path == path


# --- warnings for what gpuproxy does not do -----------------------------------------------------


@pytest.mark.parametrize(("snippet", "path"), [
    ("logLevel: debug", "logLevel"),
    ("logTimeFormat: rfc3339", "logTimeFormat"),
    ("logToStdout: both", "logToStdout"),
    ("logRequests: true", "logRequests"),
    ("metricsMaxInMemory: 5", "metricsMaxInMemory"),
    ("store: {path: /tmp/a.sqlite}", "store"),
    ("ui: {activity: {session_id: []}}", "ui"),
    ("performance: {every: 10s, sampleGpus: true}", "performance.sampleGpus"),
    ("upstream: {ignorePaths: ['x']}", "upstream.ignorePaths"),
    ("somethingElse: 1", "somethingElse"),
])
def test_each_unsupported_top_level_section_warns(snippet, path):
    parsed = parse(f"{snippet}\nmodels:\n  m: {{cmd: s}}\n")
    assert path in warned_paths(parsed), parsed.warnings


@pytest.mark.parametrize("snippet", [
    "profiles: {p: {pins: {x: m}}}",
    "selectors: {s: {strategy: pin, targets: [m]}}",
    "peers: {p: {proxy: 'http://x', models: [y]}}",
    "matrix: {sets: {s: m}}",
])
def test_the_routing_sections_are_read_without_a_warning(snippet):
    assert parse(f"{snippet}\nmodels:\n  m: {{cmd: 's --port ${{PORT}}'}}\n").warnings == []


@pytest.mark.parametrize(("snippet", "path"), [
    ("timeouts: {connect: 5}", "models.m.timeouts"),
    ("compat: {ignoreWebsockets: true}", "models.m.compat"),
    ("healthCheckTimeout: 30", "models.m.healthCheckTimeout"),
    ("colour: blue", "models.m.colour"),
    ("filters: {reasoning: {}}", "models.m.filters.reasoning"),
])
def test_each_unsupported_model_key_warns(snippet, path):
    parsed = parse(f"models:\n  m:\n    cmd: s\n    {snippet}\n")
    assert path in warned_paths(parsed), parsed.warnings


def test_comfyui_auto_specifics_warn():
    parsed = parse("models:\n  comfyui_auto: {cmd: s}\n")
    assert "models.comfyui_auto" in warned_paths(parsed)


def test_a_clean_config_has_no_warnings():
    parsed = parse("""
        models:
          m: {cmd: "server --port ${PORT}"}
        """)
    assert parsed.warnings == []


def test_capture_buffer_is_read_in_megabytes():
    """`captureBuffer` (llama-swap: MB of memory for request/response captures; 0 = none)."""
    base = "models:\n  a:\n    cmd: x --port ${PORT}\n"
    assert parse(base + "captureBuffer: 5\n").settings.capture_buffer_mb == 5
    assert parse(base).settings.capture_buffer_mb == 0
    assert "captureBuffer" in str(error(base + "captureBuffer: -1\n"))
