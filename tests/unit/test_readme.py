"""README stays true about the options: every knob is documented under its one name."""

from pathlib import Path

from pytest_gpucanary.config import KNOBS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_option_and_its_environment_variable_is_in_the_readme() -> None:
    missing = [k.flag for k in KNOBS if f"`{k.flag}`" not in README or f"`{k.env}`" not in README]
    assert missing == []
