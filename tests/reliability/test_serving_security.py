"""Security of the serving settings: keys from files and never shown, loopback unless told otherwise, and a
refusal to listen beyond loopback without a key, before anything starts."""

import pytest

from clipstream.cli import main
from clipstream.services import binding
from clipstream.settings import Settings


def test_api_key_from_a_file_is_read_stripped_and_never_shown(settings, tmp_path, monkeypatch):
    (tmp_path / "key").write_text("t0p-secret\n")
    monkeypatch.setenv("CLIPSTREAM_API_KEY_FILE", str(tmp_path / "key"))
    loaded = Settings()
    assert loaded.secret("api_key") == "t0p-secret" and loaded.api_key is None
    assert "t0p-secret" not in repr(loaded) and "t0p-secret" not in str(loaded.model_dump())
    # a child process gets the file, not the value: the key is not copied into every environment
    assert "CLIPSTREAM_API_KEY" not in loaded.env() and loaded.env()["CLIPSTREAM_API_KEY_FILE"] == str(tmp_path / "key")
    monkeypatch.delenv("CLIPSTREAM_API_KEY_FILE")
    direct = Settings(api_key="t0p-secret")
    assert "t0p-secret" not in repr(direct) and direct.secret("api_key") == "t0p-secret"
    assert direct.env()["CLIPSTREAM_API_KEY"] == "t0p-secret"  # set as a value: children need it as a value


@pytest.mark.parametrize("problem, kwargs, message", [
    ("both", {"api_key": "a-secret", "api_key_file": "KEY"}, "keep one"),
    ("missing", {"api_key_file": "nope"}, "no such file"),
    ("empty", {"api_key_file": "EMPTY"}, "is empty"),
    ("half of TLS", {"tls_cert_file": "KEY"}, "go together"),
    ("no certificate", {"tls_cert_file": "nope", "tls_key_file": "KEY"}, "no such file"),
])
def test_bad_secret_and_tls_settings_are_refused(settings, tmp_path, problem, kwargs, message):
    (tmp_path / "KEY").write_text("k")
    (tmp_path / "EMPTY").write_text("\n")
    kwargs = {k: str(tmp_path / v) if k.endswith("_file") else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message) as err:
        Settings(**kwargs)
    assert "a-secret" not in str(err.value)  # a key never appears in an error


def test_loopback_is_the_default_and_other_interfaces_need_a_key(settings, tmp_path):
    assert Settings().grpc_host == "127.0.0.1"
    for host in ("127.0.0.1", "::1", "localhost"):
        binding.check(Settings(grpc_host=host))
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(binding.BindingError, match="without an API key"):
            binding.check(Settings(grpc_host=host))
        binding.check(Settings(grpc_host=host, api_key="k"))
        binding.check(Settings(grpc_host=host, grpc_allow_unauthenticated=True))


def test_serve_refuses_all_interfaces_without_a_key_before_starting_ray(settings, monkeypatch, capsys):
    from clipstream import runtime

    started = []
    monkeypatch.setattr(runtime, "init_ray", lambda *args, **kwargs: started.append(args))  # (the session's Ray may run)
    monkeypatch.setenv("CLIPSTREAM_GRPC_HOST", "0.0.0.0")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clipstream: error:") and "\n" not in err and "API key" in err and "Traceback" not in err
    assert not started


def test_a_bad_setting_is_one_line_and_exit_2(settings, monkeypatch, capsys):
    monkeypatch.setenv("CLIPSTREAM_API_KEY_FILE", "/nonexistent/key")
    assert main(["status"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "clipstream: error: api_key_file=/nonexistent/key: no such file" or (
        err.startswith("clipstream: error:") and "\n" not in err and "no such file" in err), err


def test_a_bug_is_one_line_and_a_log_with_the_traceback(settings, monkeypatch, capsys):
    import sys

    from clipstream.cli import entry

    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr(sys, "argv", ["clipstream", "runs"])
    parser = entry.parser  # the one way to make a bug on purpose: a stand-in command
    monkeypatch.setattr(entry, "parser", lambda: _with(parser(), "runs", broken))
    assert main(["runs"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("clipstream: internal error: KeyError") and "Traceback" not in err
    log = err.split("traceback in ")[1].split(";")[0]
    assert "Traceback" in open(log).read() and "boom" in open(log).read()


def _with(parser, command, func):
    parser._subparsers._group_actions[0].choices[command].set_defaults(func=func)
    return parser
