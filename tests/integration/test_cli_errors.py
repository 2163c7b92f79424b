"""What an operator's mistakes on the command line end in: one line on stderr and exit 2, before
anything starts — never a traceback (docs/cli.md). Run as the operator runs them, in a process of
their own, so what is checked is what a terminal shows."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spine import cli


def spine(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spine", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


@pytest.fixture
def held_port() -> Iterator[str]:
    """A loopback address another socket listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield f"127.0.0.1:{holder.getsockname()[1]}"


def one_line(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    [line] = run.stderr.splitlines()
    return line


def test_a_port_in_use_is_one_line_naming_the_flag_before_any_child_starts(held_port: str, tmp_path: Path) -> None:
    for layout in ("collapsed", "layered"):
        run = spine("up", "--layout", layout, "--listen", held_port, "--http-listen", "off",
                    "--run-dir", str(tmp_path / layout))
        line = one_line(run)
        assert line.startswith(f"error: --listen {held_port}: cannot listen there") and "in use" in line
        assert not (tmp_path / layout).exists()


def test_an_http_port_in_use_is_one_line(held_port: str) -> None:
    line = one_line(spine("up", "--listen", "127.0.0.1:0", "--http-listen", held_port))
    assert line.startswith(f"error: --http-listen {held_port}: cannot listen there")


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`spine ARGS` in this interpreter (each fails before anything starts): its one stderr line."""
    assert cli.main(list(args)) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    return line


@pytest.mark.parametrize(("flag", "address"), [("--listen", "bogus"), ("--http-listen", "8099"),
                                               ("--listen", "127.0.0.1:99999"), ("--probe-listen", "unix:")])
def test_a_malformed_address_is_called_malformed_not_off_loopback(flag: str, address: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    line = in_process(capsys, "up", "--listen", "127.0.0.1:0", "--http-listen", "off", flag, address)
    assert line.startswith(f"error: {flag} {address!r}:") and "not loopback" not in line
    assert "HOST:PORT" in line or "socket path" in line


def test_files_named_on_the_command_line_that_do_not_exist_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert in_process(capsys, "migrate", "plan", "--offline", "nope.yaml") == "error: nope.yaml: No such file or directory"
    assert in_process(capsys, "keys", "import", "nokeys.txt") == "error: nokeys.txt: No such file or directory"
    assert "nope.yaml" in in_process(capsys, "--config", "nope.yaml", "config", "check")
    assert "nope.yaml" in in_process(capsys, "config", "check", "nope.yaml")


def test_a_reader_that_goes_away_ends_the_output_quietly() -> None:
    """`spine config schema | head -1`."""
    process = subprocess.Popen([sys.executable, "-m", "spine", "config", "schema"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().strip() == "{"
    process.stdout.close()
    assert process.wait(timeout=60) == 0
    assert process.stderr.read() == ""


def test_config_check_refuses_what_up_refuses_with_file_and_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "spine.yaml"
    config.write_text("router:\n  models:\n    - id: llama\n      upstream:\n"
                      "        base_url: http://127.0.0.1:9/v1\n"
                      f"        api_key_file: {tmp_path / 'missing-key'}\n")
    assert cli.main(["--config", str(config), "config", "check"]) == 2
    checked = capsys.readouterr().err.splitlines()
    assert cli.main(["--config", str(config), "up", "--listen", "127.0.0.1:0", "--http-listen", "off",
                     "--run-dir", str(tmp_path / "run")]) == 2
    refused = capsys.readouterr().err.splitlines()
    assert checked == refused == [f"config error: {config}:6: router.models[0].upstream.api_key_file: cannot read "
                                  f"{tmp_path / 'missing-key'}: No such file or directory"]
    assert not (tmp_path / "run").exists()
    (tmp_path / "missing-key").write_text("sk-upstream\n")
    assert cli.main(["config", "check", str(config)]) == 0
    assert capsys.readouterr().out == f"{config}: ok\n"


def test_the_controller_on_a_port_in_use_is_one_line(held_port: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("test-admin-token-0123456789\n")
    token.chmod(0o600)
    base = [sys.executable, "-m", "migration.runner", "--db", str(tmp_path / "m.db"), "--admin-token-file",
            str(token), "--target", "recording"]
    for extra in (["--listen", held_port], ["--listen", f"unix:{tmp_path}/c.sock", "--dashboard-listen", held_port]):
        run = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        line = one_line(run)
        assert line.startswith(f"error: {extra[-2]} {held_port}: cannot listen there")
