"""tests/cli.py's own status reading: multiprocessing's forkserver answers 255 when the child's
status report is lost; the status the child recorded on leaving `main` is its status then."""

from tests.cli import _exit_status, run_cli


def test_a_lost_status_report_is_read_from_what_the_child_recorded(tmp_path):
    recorded = tmp_path / "status"
    recorded.write_text("2")
    assert _exit_status(255, recorded) == 2
    assert _exit_status(1, recorded) == 1  # a status that did arrive stands
    assert _exit_status(255, tmp_path / "absent") == 255  # died without recording one


def test_the_cli_child_records_its_status(tmp_path):
    assert run_cli("dequant", str(tmp_path / "absent"), "--out", str(tmp_path / "out")).returncode == 2
