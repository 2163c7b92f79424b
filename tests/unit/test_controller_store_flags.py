"""The runner's flags for where the state lives and whether replicas elect a leader."""

from __future__ import annotations

import pytest

from migration.leadership import LeaseSettings
from migration.runner import parse_args, store_of
from migration.store_backends import redacted
from services.common import ConfigError

BASE = ["--listen", "unix:/tmp/x.sock", "--target", "recording"]


def test_a_sqlite_file_is_one_controller_without_election_unless_asked():
    assert store_of(parse_args([*BASE, "--db", "/tmp/m.db"])) == ("/tmp/m.db", None)
    location, lease = store_of(parse_args([*BASE, "--db", "/tmp/m.db", "--leader-elect"]))
    assert lease == LeaseSettings()


def test_postgres_always_elects_with_the_lease_settings_given():
    location, lease = store_of(parse_args([*BASE, "--db", "postgresql://spine@db:5432/spine",
                                           "--lease-duration-s", "4", "--lease-renew-deadline-s", "3",
                                           "--lease-retry-period-s", "0.5"]))
    assert lease == LeaseSettings(4.0, 3.0, 0.5)


def test_a_password_on_the_command_line_is_refused_and_never_echoed():
    with pytest.raises(ConfigError, match="--db-dsn-file") as refused:
        store_of(parse_args([*BASE, "--db", "postgresql://spine:hunter2@db:5432/spine"]))
    assert "hunter2" not in str(refused.value)


def test_the_dsn_file_must_be_private_and_hold_a_postgres_dsn(tmp_path):
    dsn = tmp_path / "dsn"
    dsn.write_text("postgresql://spine:hunter2@db:5432/spine\n")
    dsn.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by other users"):
        store_of(parse_args([*BASE, "--db-dsn-file", str(dsn)]))
    dsn.chmod(0o600)
    assert store_of(parse_args([*BASE, "--db-dsn-file", str(dsn)]))[0].startswith("postgresql://")
    dsn.write_text("/var/lib/spine/m.db\n")
    with pytest.raises(ConfigError, match="expected a PostgreSQL DSN"):
        store_of(parse_args([*BASE, "--db-dsn-file", str(dsn)]))


def test_exactly_one_store_is_named():
    with pytest.raises(ConfigError, match="give the state store once"):
        store_of(parse_args(BASE))


def test_impossible_lease_timings_are_refused_naming_the_flags():
    with pytest.raises(ConfigError, match="--lease-retry-period-s"):
        store_of(parse_args([*BASE, "--db", "/tmp/m.db", "--leader-elect", "--lease-retry-period-s", "12"]))


def test_a_dsn_in_a_log_line_has_no_password():
    assert redacted("postgresql://spine:hunter2@db:5432/spine") == "postgresql://spine@db:5432/spine"
    assert redacted("/var/lib/spine/m.db") == "/var/lib/spine/m.db"
