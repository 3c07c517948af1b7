from conftest import REPO

from ddp import config


def test_readme_config_reference_is_current():
    assert config.reference() in (REPO / "README.md").read_text()


def test_readme_quick_start_is_two_make_commands():
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```", 2)[1]  # "bash\nmake train ...\nmake test ...\n"
    commands = [line.split()[:2] for line in block.splitlines()[1:] if line.strip()]
    assert commands == [["make", "train"], ["make", "test"]]
