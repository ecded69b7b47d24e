"""`kvlab-store bench`: nonsense sizes and counts are refused before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab_connector.cli import main


@pytest.mark.parametrize(("flag", "value"), [
    ("--size-mib", "-5"), ("--size-mib", "0"), ("--size-mib", "1.5"),
    ("--threads", "0"), ("--threads", "-1"), ("--ring-mib", "0"),
])
def test_a_nonsense_value_is_refused_naming_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str,
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--path", str(tmp_path / "d0"), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and repr(value) in err
    assert not (tmp_path / "d0").exists(), "nothing ran"


def test_good_values_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--path", str(tmp_path / "d0"), "--size-mib", "8", "--threads", "2",
                 "--ring-mib", "8", "--verify"]) == 0
    assert "verified True" in capsys.readouterr().out


@pytest.mark.parametrize(("arg", "value"), [("size_mib", 0), ("size_mib", -5), ("sections", 0), ("ring_mib", 0),
                                            ("threads", 0)])
def test_the_bench_itself_refuses_nonsense_naming_it(tmp_path: Path, arg: str, value: int) -> None:
    from kvlab_connector.bench import run_store

    with pytest.raises(ValueError, match="io_threads" if arg == "threads" else arg):
        run_store([tmp_path / "d0"], **{"size_mib": 8, "ring_mib": 8, arg: value})
