"""tritonserver's command line as Triton 2.51 parses it (probed side by side): getopt's unique
prefixes, case-insensitive bools and control modes, a case-sensitive log format, and its
refusals with its wording."""

from __future__ import annotations

from pathlib import Path

import pytest

from pier.cli import build_parser, settings_from_args
from pier.settings import Settings

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def _settings(*flags: str) -> Settings:
    parser = build_parser()
    return settings_from_args(parser.parse_args(["serve", f"--model-repository={REPO}", *flags]), parser)


def _refused(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    with pytest.raises(SystemExit) as exc:
        _settings(*flags)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_a_unique_prefix_of_a_long_option_is_that_option() -> None:
    s = _settings("--log-warn=false", "--log-i=0", "--strict-read=false")
    assert (s.log_warning, s.log_info, s.strict_readiness) == (False, False, False)


def test_an_ambiguous_prefix_is_refused_naming_the_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(capsys, "--log-=true")
    assert "ambiguous option: --log-=true" in err and "--log-info" in err and "--log-verbose" in err


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("TRUE", True), ("On", True), ("true", True),
                                                 ("0", False), ("FALSE", False), ("off", False)])
def test_bool_values_as_triton_reads_them(value: str, expected: bool) -> None:
    assert _settings(f"--log-info={value}").log_info is expected


@pytest.mark.parametrize("value", ["yes", "no", '"true"', "junk", ""])
def test_other_bool_values_are_refused_with_tritons_message(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"invalid value for bool option: {value}" in _refused(capsys, f"--log-info={value}")


def test_the_control_mode_in_any_case() -> None:
    assert _settings("--model-control-mode=POLL").model_control_mode == "poll"
    assert _settings("--model-control-mode=Explicit").model_control_mode == "explicit"


def test_a_bad_control_mode_and_a_log_format_in_another_case_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid argument for --model-control-mode: 'bogus'" in _refused(capsys, "--model-control-mode=bogus")
    assert "invalid argument for --log-format: 'iso8601'" in _refused(capsys, "--log-format=iso8601")
    assert _settings("--log-format=ISO8601").log_format == "ISO8601"


def _parse(*argv: str) -> Settings:
    parser = build_parser()
    return settings_from_args(parser.parse_args(["serve", *argv]), parser)


def test_serve_path_takes_one_model_or_a_repository(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"")
    s = _parse(str(tmp_path / "m.onnx"), "--served-model-name=net")
    assert (s.serve_path, s.served_model_name, s.model_repositories) == ((tmp_path / "m.onnx").resolve(), "net", ())
    s = _parse(str(REPO))  # a repository as PATH: one more repository, as --model-repository
    assert s.serve_path is None and s.model_repositories == (REPO.resolve(),)


def test_serve_needs_something_to_serve(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv, message in ((["--http-port=1"], "nothing to serve: give PATH (a model) or --model-repository"),
                          ([f"--model-repository={REPO}", "--served-model-name=x"], "give PATH"),
                          ([str(tmp_path / "x.gguf")], "no such file or folder")):
        with pytest.raises(SystemExit) as exc:
            _parse(*argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
